"""Per-step metrics of a run: one JSON object per line in ``metrics.jsonl`` (plot it with
`unirl plot RUN_DIR` or any JSONL reader), TensorBoard events when tensorboard is installed
and enabled, and the same records to Weights & Biases with ``logging.wandb``. Written by the
reporting rank only.

A killed process or a full disk can leave the last line cut off. Opening the log drops such a
line (with a warning) before appending, and readers skip it, so a resumed run never glues its
first record onto half of an old one and never fails to parse the file."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from unirl.core.run.wandb_log import WandbLog

logger = logging.getLogger(__name__)


def dashboard_name(key: str) -> str:
    """The name a metric has in TensorBoard and W&B: the flat names of the step's loss terms and
    counters (``loss``, ``grad_norm``, ``pg_clipfrac``, ...) under ``train/``, so dashboards group
    every metric by namespace; ``metrics.jsonl`` keeps the names as the code writes them."""
    return key if "/" in key else f"train/{key}"


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN / inf; keep them visible
    return value


class MetricsLog:
    def __init__(
        self,
        run_dir: Path,
        *,
        tensorboard: bool,
        resume_from_step: int | None = None,
        wandb: WandbLog | None = None,
    ) -> None:
        """``wandb``: a W&B run that gets every record too (`unirl.core.run.wandb_log`)."""
        self.path = run_dir / "metrics.jsonl"
        run_dir.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            self._keep_whole_lines(resume_from_step)
        self._file = self.path.open("a")
        self._tb = None
        self._wandb = wandb
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                logger.info("tensorboard is not installed: metrics go to %s only", self.path)
            else:
                self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def _keep_whole_lines(self, step: int | None) -> None:
        keep_whole_lines(self.path, step)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(dashboard_name(key), value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.write(step, metrics)

    def write_table(self, name: str, step: int, rows: list[dict[str, Any]]) -> None:
        """``rows`` (one dict per row, the same keys) as a TensorBoard text table and a W&B
        table named ``name`` (the JSONL sinks of tables are their own files)."""
        if not rows:
            return
        if self._tb is not None:
            columns = list(rows[0])
            lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            for row in rows:
                cells = (str(row[c]).replace("|", "\\|").replace("\n", " ") for c in columns)
                lines.append("| " + " | ".join(cells) + " |")
            self._tb.add_text(name, "\n".join(lines), step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.write_table(name, step, rows)

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.close()
        if self._tb is not None:
            self._tb.close()


def keep_whole_lines(path: Path, step: int | None) -> None:
    """Drop cut-off lines of the JSONL file ``path`` and, on resume, the records after step
    ``step`` (the resumed run writes them again). Rewritten through a temporary file and a
    rename: a crash here leaves the old file or the new one, never half of it."""
    records, dropped = _parse_lines(path.read_bytes())
    if dropped:
        logger.warning(
            "%s: dropped %d cut-off line(s) (a write interrupted by a crash or a full disk)",
            path,
            dropped,
        )
    kept = [line for line, rec in records if step is None or rec.get("step", 0) <= step]
    if not dropped and len(kept) == len(records):
        return
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as handle:
        handle.write("".join(f"{line}\n" for line in kept))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _parse_lines(data: bytes) -> tuple[list[tuple[str, dict[str, Any]]], int]:
    """(line, record) of every whole JSON-object line, and how many lines were not whole."""
    records, dropped = [], 0
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8")
            record = json.loads(line)
        except ValueError:  # cut off mid-line (also mid UTF-8 character)
            dropped += 1
            continue
        if not isinstance(record, dict):
            dropped += 1
            continue
        records.append((line, record))
    return records, dropped


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every whole record of a metrics file; a cut-off line (a crash mid-write) is skipped."""
    records, dropped = _parse_lines(Path(path).read_bytes())
    if dropped:
        logger.warning("%s: skipped %d cut-off line(s)", path, dropped)
    return [record for _, record in records]
