"""`PackedModule`: a Hugging Face model (or the engine that wraps it) as the microbatch loop runs
it. Frozen as it stands (the reference); an engine's trained-model class (the policy and the
critic alike) adds the backward, the optimizer step and the export."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal, Protocol

import attrs
import torch

from unirl.backends.forward_only import forward_only
from unirl.backends.hf.loop import TrainedPackedModel
from unirl.core.backend import OptimizerStepStats
from unirl.core.config.run_config import OptimizerConfig
from unirl.core.data.microbatch import TrainMicrobatch
from unirl.core.weights.stream import HOST, WeightBuckets

# run(module, microbatch) -> the model's ``.logits[0]``: the engine's packed forward
PackedForward = Callable[[Any, TrainMicrobatch], torch.Tensor]


@attrs.frozen
class Training:
    """What a trained model is built with: its role, its optimizer section (``key`` names it in
    errors) and the number of optimizer steps its LR schedule spans."""

    role: Literal["policy", "critic"]
    optimizer: OptimizerConfig
    key: str
    total_steps: int


class PackedModule:
    """Implements `unirl.backends.hf.loop.PackedModel`. ``module`` is what is called (a DeepSpeed
    engine or a sharded HF model); ``offloaded``: it lives in CPU memory and is moved to
    ``device`` for each forward-only pass."""

    def __init__(
        self, module: Any, *, device: torch.device, run: PackedForward, offloaded: bool = False
    ) -> None:
        self.module = module
        self.device = device
        self._run = run
        self._offloaded = offloaded

    @property
    def hf_module(self) -> torch.nn.Module:
        """The Hugging Face module itself (the one whose forward a test may hook)."""
        return self.module

    def forward(self, mb: TrainMicrobatch) -> torch.Tensor:
        return self._run(self.module, mb)

    def forward_only(self) -> AbstractContextManager[None]:
        return forward_only([self.module], device=self.device, offloaded=self._offloaded)

    def close(self) -> None:
        self.module = None


class TrainedModel(TrainedPackedModel, Protocol):
    """What a backend holds for each trained model (the policy, the critic): the loop's
    interface plus the optimizer step and the Hugging Face export."""

    @property
    def hf_module(self) -> torch.nn.Module: ...

    def optimizer_step(self) -> OptimizerStepStats:
        """Clip, step, advance the LR schedule; the norm is the global one before clipping."""
        ...

    def export_hf(self, path: Path) -> None:
        """Collective: every rank calls it; rank 0 writes the Hugging Face folder."""
        ...

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The full weights in Hugging Face names, on the CPU, on every rank (collective)."""
        ...

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The parameters that train (all of them, or a LoRA adapter's), full, in the module's
        names, on the CPU, on every rank (collective); the frozen ones are not gathered."""
        ...

    def stream_weights(
        self, bucket_bytes: int, *, dst: int | None, device: torch.device = HOST
    ) -> WeightBuckets:
        """`hf_state_dict`'s tensors in buckets on ``device`` (`unirl.core.weights.stream`;
        collective)."""
        ...

    def non_finite_weight(self) -> str | None:
        """The first non-finite parameter, from local shards (collective)."""
        ...

    def close(self) -> None: ...
