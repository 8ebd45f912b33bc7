"""The part of `TrainingBackend`'s passes that is the same on every engine, written once: argument
checks, the forward-only log-prob spec, and the forward counters the contract suite reads. A
backend subclasses `EngineBackend` and implements `_forward_logprobs` and `_forward_backward`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import torch

from unirl.core.backend import CriticModel, LossFn, ModelRole
from unirl.core.data.microbatch import TrainMicrobatch
from unirl.core.maths.logprob_spec import LogprobSpec
from unirl.core.maths.losses import Metric
from unirl.core.progress.bars import MicrobatchProgress

ROLES: tuple[ModelRole, ...] = ("policy", "reference")


@attrs.frozen(kw_only=True)
class ForwardOnlyPass:
    """One checked `TrainingBackend.forward_logprobs` call, as the backend's hook receives it."""

    microbatches: Sequence[TrainMicrobatch]
    role: ModelRole
    spec: LogprobSpec  # without entropy
    progress: MicrobatchProgress


@attrs.frozen(kw_only=True)
class TrainingPass:
    """One checked `TrainingBackend.forward_backward` call (at least one microbatch)."""

    microbatches: Sequence[TrainMicrobatch]
    loss_fn: LossFn
    spec: LogprobSpec
    progress: MicrobatchProgress


def check_microbatches(microbatches: Sequence[TrainMicrobatch], call: str) -> None:
    """A training pass needs at least one microbatch on every rank."""
    if not microbatches:
        raise ValueError(
            f"{call} got no microbatches; the plan gives every rank at least one "
            "(an empty one where a rank has no tokens) so the collectives stay in step"
        )


class EngineBackend:
    """`forward_calls` counts model forwards per role and microbatch (training and forward-only
    alike; under virtual pipeline stages once per microbatch, not once per chunk), so a test can
    prove that a forward-only pass was skipped."""

    def __init__(self) -> None:
        self.forward_calls: dict[ModelRole, int] = dict.fromkeys(ROLES, 0)
        self.critic: CriticModel | None = None  # a backend with a critic builds it

    def _count_forward(self, role: ModelRole) -> None:
        self.forward_calls[role] += 1

    def forward_logprobs(
        self,
        microbatches: Sequence[TrainMicrobatch],
        *,
        role: ModelRole,
        spec: LogprobSpec,
        progress: MicrobatchProgress,
    ) -> list[torch.Tensor]:
        """Detached fp32 log-probs ``[T]`` per microbatch, on the device, where the loss lives
        ([] on other pipeline stages)."""
        if role not in ROLES:
            raise ValueError(f"forward_logprobs role={role!r}; choose one of {ROLES}")
        # old / reference log-probs only: no entropy, no gradient
        spec = attrs.evolve(spec, with_entropy=False, entropy_grad=False)
        return self._forward_logprobs(
            ForwardOnlyPass(microbatches=microbatches, role=role, spec=spec, progress=progress)
        )

    def forward_backward(
        self,
        microbatches: Sequence[TrainMicrobatch],
        *,
        loss_fn: LossFn,
        spec: LogprobSpec,
        progress: MicrobatchProgress,
    ) -> list[Mapping[str, Metric]]:
        """Accumulate the gradients of every microbatch of one optimizer step; per-microbatch
        metrics where the loss lives."""
        check_microbatches(microbatches, "forward_backward")
        return self._forward_backward(
            TrainingPass(microbatches=microbatches, loss_fn=loss_fn, spec=spec, progress=progress)
        )

    def _forward_logprobs(self, run: ForwardOnlyPass) -> list[torch.Tensor]:
        raise NotImplementedError

    def _forward_backward(self, run: TrainingPass) -> list[Mapping[str, Metric]]:
        raise NotImplementedError
