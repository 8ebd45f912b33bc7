"""The optimizer of a trained Hugging Face model, the same on every HF engine: torch's AdamW with
weight decay on matrices and embeddings only, and unirl's LR schedule
(`unirl.core.run.lr_schedule`, shared with Megatron) applied by `ScheduledLR` after each applied
optimizer step (its position is saved in checkpoints).

Why a client torch AdamW: DeepSpeed's own "AdamW" type JIT-compiles a fused op on the CPU (slow,
fragile), while torch's AdamW works under ZeRO 0-3 and on FSDP2's DTensor parameters. 1-D
parameters (biases, norm weights) skip weight decay, as Megatron and the HF Trainer do.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from unirl.core.config.run_config import OptimizerConfig
from unirl.core.run.lr_schedule import check_schedule, learning_rate


class ScheduledLR:
    """Sets ``lr = schedule(optimizer steps taken)`` on every param group; the engine calls
    `step` after each applied optimizer step and saves `state_dict` in its checkpoints."""

    def __init__(self, optimizer: Any, schedule: Callable[[int], float]) -> None:
        self.optimizer = optimizer
        self.schedule = schedule
        self.steps_done = 0
        self._apply()

    def _apply(self) -> None:
        lr = self.schedule(self.steps_done)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, *args: Any, **kwargs: Any) -> None:
        self.steps_done += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, int]:
        return {"steps_done": self.steps_done}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.steps_done = int(state["steps_done"])
        self._apply()


def adamw_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices and embeddings; not biases and norm weights (1-D)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def adamw(
    model: torch.nn.Module, opt: OptimizerConfig, *, total_steps: int, key: str
) -> tuple[torch.optim.AdamW, Callable[[int], float]]:
    """AdamW over ``model`` from the optimizer section ``opt`` (named ``key`` in errors) and its
    LR schedule (optimizer steps taken -> lr), for `ScheduledLR`."""
    check_schedule(opt, total_steps, key=key)
    optimizer = torch.optim.AdamW(
        adamw_param_groups(model, opt.weight_decay),
        lr=opt.lr,
        betas=tuple(opt.betas),
        eps=opt.eps,
        weight_decay=opt.weight_decay,
    )
    return optimizer, functools.partial(learning_rate, optimizer=opt, total_steps=total_steps)
