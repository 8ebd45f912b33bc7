"""Per-step metrics of a run: one JSON object per line in ``metrics.jsonl`` (plot it with
`unirl plot RUN_DIR` or any JSONL reader), and TensorBoard events when tensorboard is installed
and enabled. Written by the reporting rank only."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN / inf; keep them visible
    return value


class MetricsLog:
    def __init__(
        self, run_dir: Path, *, tensorboard: bool, resume_from_step: int | None = None
    ) -> None:
        self.path = run_dir / "metrics.jsonl"
        run_dir.mkdir(parents=True, exist_ok=True)
        if resume_from_step is not None and self.path.exists():
            self._truncate_after(resume_from_step)
        self._file = self.path.open("a")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                logger.info("tensorboard is not installed: metrics go to %s only", self.path)
            else:
                self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def _truncate_after(self, step: int) -> None:
        """A resumed run rewrites the steps after its checkpoint: drop them from the log."""
        kept = []
        for line in self.path.read_text().splitlines():
            if line.strip() and json.loads(line).get("step", 0) <= step:
                kept.append(line)
        self.path.write_text("".join(f"{line}\n" for line in kept))

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
