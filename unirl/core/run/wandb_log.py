"""Weights & Biases logging (``logging.wandb: {project, name, mode}``): every record written to
``metrics.jsonl`` is logged to one W&B run, from the reporting rank, at the same step.

Why it refuses to start without wandb rather than warn: a user who wrote ``logging.wandb``
watches the run there, and a warning line at start scrolls away while the whole run goes
unlogged; the config check (`unirl check`, and `unirl train` before any work) says so at once
(``_check_wandb`` in `unirl.core.config.run_config`). The W&B run's id is unirl's run id, so ``--resume`` continues the
same W&B run (``resume="allow"``). Its files go under ``RUN_DIR/wandb`` (``mode: offline``
writes nothing else: ``wandb sync RUN_DIR/wandb/offline-run-*`` uploads it later). Values
that are not finite numbers are left out (W&B plots numbers; metrics.jsonl keeps them).

    log = WandbLog(cfg.logging.wandb, run_dir, run_id=run_id, config=cfg.to_dict())
    log.write(step, metrics); log.close()
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from unirl.core.config.run_config import WandbConfig
from unirl.core.run.metrics_log import dashboard_name

logger = logging.getLogger(__name__)


class WandbLog:
    """One W&B run that receives every metrics record."""

    def __init__(
        self, options: WandbConfig, run_dir: Path, *, run_id: str, config: Mapping[str, Any]
    ) -> None:
        import wandb  # installed: the config check refuses logging.wandb without it

        folder = run_dir / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("WANDB_SILENT", "true")  # unirl's own lines say what matters
        self._run = wandb.init(
            project=options.project,
            name=options.name or run_dir.resolve().name,
            mode=options.mode,
            dir=str(run_dir),
            id=run_id,
            resume="allow",
            config=dict(config),
        )
        logger.info(
            "Weights & Biases: run %s/%s (%s)%s",
            self._run.project, self._run.name, options.mode,
            f", files in {folder}" if options.mode == "offline" else "",
        )  # fmt: skip

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        values = {
            dashboard_name(k): v
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        }
        self._run.log(values, step=step)

    def write_table(self, name: str, step: int, rows: list[dict[str, Any]]) -> None:
        import wandb

        columns = list(rows[0])
        table = wandb.Table(columns=columns, data=[[row[c] for c in columns] for row in rows])
        self._run.log({name: table}, step=step)

    def close(self) -> None:
        self._run.finish()
