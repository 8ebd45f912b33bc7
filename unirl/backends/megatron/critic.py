"""PPO's critic on megatron-core: a trained `MegatronModel` like the policy (the same layers, TP /
PP / VPP / CP layout, schedules and microbatch loop, `passes`) whose output layer is a
`heads.ValueHead`, with its own DDP and optimizer (``critic.optimizer``; ``critic.zero_stage: 1``
= the distributed optimizer). Its weights come from `sources.critic_source`. The loss is core's;
the only factor is the backend's `schedule.loss_scale`.

`MegatronCritic` is what core's RL step drives (`unirl.core.backend.CriticModel`): the model and
the backend's loop, nothing of its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from unirl.backends.base import check_microbatches
from unirl.backends.megatron.heads import ValueOutput
from unirl.backends.megatron.passes import MicrobatchLoop
from unirl.backends.megatron.role_model import MegatronModel, OptimizerPlan, build_chunks
from unirl.backends.megatron.sources import critic_source
from unirl.core.backend import OptimizerStepStats, ValueLossFn
from unirl.core.config.run_config import UnirlConfig
from unirl.core.critic import critic_optimizer_steps
from unirl.core.data.microbatch import TrainMicrobatch
from unirl.core.maths.losses import Metric
from unirl.core.progress.bars import MicrobatchProgress


def critic_plan(cfg: UnirlConfig, policy_optimizer_steps: int) -> OptimizerPlan:
    """The critic's optimiser: ``critic.optimizer`` over its own steps (warm-up included);
    ``critic.zero_stage`` (unset: the policy's ``parallel.zero_stage``) 1 = distributed."""
    stage = cfg.critic.zero_stage
    return OptimizerPlan(
        name="critic",
        key="critic.optimizer",
        section=cfg.critic.optimizer,
        total_steps=critic_optimizer_steps(cfg, policy_optimizer_steps),
        distributed=(cfg.parallel.zero_stage if stage is None else stage) == 1,
    )


class MegatronCritic:
    """See the module docstring. ``forward_calls``: model forwards, one per microbatch."""

    def __init__(self, model: MegatronModel, loop: MicrobatchLoop) -> None:
        self.model = model
        self._loop = loop
        self.forward_calls = 0

    @classmethod
    def build(
        cls, cfg: UnirlConfig, plan: OptimizerPlan, loop: MicrobatchLoop, *, dtype: torch.dtype
    ) -> MegatronCritic:
        source = critic_source(cfg)
        chunks = build_chunks(source, cfg, loop.topology, dtype=dtype, value_head=True)
        model = MegatronModel(
            chunks,
            hf_config=source.hf_config,
            head=ValueOutput(),
            cfg=cfg,
            topology=loop.topology,
            plan=plan,
        )
        return cls(model, loop)

    def _count(self) -> None:
        self.forward_calls += 1

    def forward_values(
        self, microbatches: Sequence[TrainMicrobatch], *, progress: MicrobatchProgress
    ) -> list[torch.Tensor]:
        return self._loop.forward_only(
            self.model, microbatches, spec=None, on_forward=self._count, progress=progress
        )

    def forward_backward(
        self,
        microbatches: Sequence[TrainMicrobatch],
        *,
        loss_fn: ValueLossFn,
        progress: MicrobatchProgress,
    ) -> list[Mapping[str, Metric]]:
        check_microbatches(microbatches, "critic forward_backward")
        return self._loop.train(
            self.model,
            microbatches,
            loss_fn=loss_fn,
            spec=None,
            on_forward=self._count,
            progress=progress,
        )

    def optimizer_step(self) -> OptimizerStepStats:
        return self.model.optimizer_step()

    def export_hf(self, path: Path) -> None:
        self.model.export_hf(path)

    def close(self) -> None:
        self.model.close()
