"""The learning-rate schedule, backend-neutral: linear warmup, then constant, linear or cosine decay
to ``min_lr_ratio * lr``.

With ``s`` the number of optimizer steps already taken (0 for the first step), ``W`` the warmup
steps and ``N`` the total optimizer steps of the run, the step uses ``lr * m(s)`` where::

    m(s) = (s + 1) / W                          for s < W   (the first step is not wasted at lr 0;
                                                             the last warmup step reaches lr)
    p    = min(1, (s - W) / max(1, N - W))      for s >= W  (decay progress)
    m(s) = 1                                    constant
    m(s) = r + (1 - r) * (1 - p)                linear,  r = min_lr_ratio
    m(s) = r + (1 - r) * (1 + cos(pi p)) / 2    cosine   (Loshchilov & Hutter, SGDR, 2017)

The decay reaches ``r`` at ``s = N`` (one past the last step), like Hugging Face's schedulers.
"""

from __future__ import annotations

import math

from unirl.core.config.run_config import OptimizerConfig
from unirl.core.errors import ConfigError


def lr_multiplier(
    step: int, *, schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float
) -> float:
    """The factor ``m(s)`` above for the step taken after `step` earlier optimizer steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "linear":
        return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - progress)
    if schedule == "cosine":
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ConfigError(
        f"optimizer.lr_schedule={schedule!r} is not a schedule; choose constant, linear or cosine"
    )


def learning_rate(step: int, optimizer: OptimizerConfig, total_steps: int) -> float:
    """The learning rate of the optimizer step taken after `step` earlier steps."""
    return optimizer.lr * lr_multiplier(
        step,
        schedule=optimizer.lr_schedule,
        warmup_steps=optimizer.warmup_steps,
        total_steps=total_steps,
        min_lr_ratio=optimizer.min_lr_ratio,
    )


def check_schedule(optimizer: OptimizerConfig, total_steps: int, *, key: str = "optimizer") -> None:
    """Setup-time checks of the schedule against the run length (raise `ConfigError`); ``key``
    names the section in the messages (``critic.optimizer`` for the critic's)."""
    if total_steps < 1:
        raise ConfigError(
            f"total optimizer steps={total_steps} must be >= 1 (train.rl_steps x optimizer steps "
            "per rollout)"
        )
    if optimizer.min_lr_ratio > 1:
        raise ConfigError(
            f"{key}.min_lr_ratio={optimizer.min_lr_ratio} must be in [0, 1] (the final lr "
            "as a fraction of the lr)"
        )
    if optimizer.lr_schedule != "constant" and optimizer.warmup_steps >= total_steps:
        raise ConfigError(
            f"{key}.warmup_steps={optimizer.warmup_steps} leaves no step for the "
            f"{optimizer.lr_schedule} decay of a run of {total_steps} optimizer steps; lower "
            "warmup_steps or use lr_schedule: constant"
        )
