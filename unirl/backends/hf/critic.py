"""PPO's critic on a Hugging Face engine: the one-label token classifier of
`unirl.backends.causal_lm.load_critic` (the policy's backbone + ``Linear(hidden, 1)``), held by its
backend as one more trained model of the engine's own class (its own optimizer from
``critic.optimizer`` and LR schedule, the policy's processes and layout). The passes are the
shared loop's with the value head; the loss is core's (`unirl.core.maths.losses.critic`), scaled
by the model's factor (the policy's: the engine averages gradients the same way)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from unirl.backends.base import check_microbatches
from unirl.backends.hf.loop import HeadOutput, forward_only_pass, training_pass, value_head
from unirl.backends.hf.model import TrainedModel
from unirl.core.backend import OptimizerStepStats, ValueLossFn
from unirl.core.data.microbatch import TrainMicrobatch
from unirl.core.maths.losses import Metric
from unirl.core.progress.bars import MicrobatchProgress


class HFCritic:
    """Implements `unirl.core.backend.CriticModel` on the trained ``model``."""

    def __init__(self, model: TrainedModel) -> None:
        self.model = model
        self.forward_calls = 0  # model forwards, one per microbatch

    def _count(self) -> None:
        self.forward_calls += 1

    def forward_values(
        self, microbatches: Sequence[TrainMicrobatch], *, progress: MicrobatchProgress
    ) -> list[torch.Tensor]:
        return forward_only_pass(
            self.model, value_head, microbatches, progress=progress, count=self._count
        )

    def forward_backward(
        self,
        microbatches: Sequence[TrainMicrobatch],
        *,
        loss_fn: ValueLossFn,
        progress: MicrobatchProgress,
    ) -> list[Mapping[str, Metric]]:
        check_microbatches(microbatches, "critic forward_backward")

        def loss(mb: TrainMicrobatch, out: HeadOutput):
            return loss_fn(mb, out.values)

        return training_pass(
            self.model, value_head, microbatches, loss=loss, progress=progress, count=self._count
        )

    def optimizer_step(self) -> OptimizerStepStats:
        return self.model.optimizer_step()

    def export_hf(self, path: Path) -> None:
        self.model.export_hf(path)

    def close(self) -> None:
        self.model.close()
