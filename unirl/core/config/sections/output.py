"""The sections of what a run writes and shows: ``progress``, ``checkpoint`` and ``logging``."""

from __future__ import annotations

from typing import Literal

import attrs

from unirl.core.config.validators import (
    finite,
    non_negative,
    positive,
)


@attrs.frozen(kw_only=True)
class ProgressConfig:
    """Bars on a terminal (run, generation, each training phase; `unirl.core.progress.bars`)."""

    enabled: bool = True
    # Without bars (a log file, UNIRL_PROGRESS=0): the per-step INFO lines (the step line and
    # each phase's summary) every this many RL steps, and for the last step.
    log_every: int = attrs.field(default=1, validator=positive)


@attrs.frozen(kw_only=True)
class CheckpointConfig:
    """When the run saves a resumable checkpoint: every ``every`` RL steps (0: not by count),
    whenever ``every_minutes`` of wall time passed since the last save (0: not by time), and
    after the last step. The time default makes a long run survive a crash with at most that
    much work lost, whatever its step time."""

    dir: str | None = None
    every: int = attrs.field(default=0, validator=non_negative)
    every_minutes: float = attrs.field(default=30.0, validator=[finite, non_negative])
    keep: int = attrs.field(default=2, validator=positive)
    export_hf: bool = True


@attrs.frozen(kw_only=True)
class WandbConfig:
    """``logging.wandb`` (`unirl.core.run.wandb_log`): the run is ``project``/``name`` (project
    None: W&B's own default, WANDB_PROJECT or "uncategorized"; name None: the run folder's
    name); ``mode: offline`` writes under RUN_DIR/wandb for ``wandb sync`` later."""

    project: str | None = None
    name: str | None = None
    mode: Literal["online", "offline"] = "online"


@attrs.frozen(kw_only=True)
class LoggingConfig:
    run_dir: str = "runs/unirl"
    # unirl's log level; the engines (DeepSpeed, torch.distributed, vLLM, transformers) log only
    # errors unless it is DEBUG (`unirl.log_setup`).
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    tensorboard: bool = True
    # What the policy generates (`unirl.core.run.completions_log`): the first
    # completions_per_step samples of the rollout every completions_every RL steps (and at step
    # 1) into RUN_DIR/completions.jsonl and the TensorBoard / W&B "completions" table; 0: off.
    completions_every: int = attrs.field(default=10, validator=non_negative)
    completions_per_step: int = attrs.field(default=4, validator=positive)
    # Weights & Biases: the metrics of metrics.jsonl, from the reporting rank; None = off.
    wandb: WandbConfig | None = None
