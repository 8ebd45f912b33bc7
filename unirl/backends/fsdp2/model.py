"""The models an `Fsdp2Backend` holds: `Fsdp2Model`, one trained model sharded with
`fully_shard` (the policy and the critic alike: the same mesh, mixed precision and offload; own
AdamW and LR schedule), and the frozen reference, a sharded `PackedModule`. Each runs packed
microbatches through varlen attention, under Ulysses SP on this rank's tokens
(`unirl.backends.fsdp2.packed.forward`).

The only loss arithmetic is `Fsdp2Model.loss_scale`. Core losses are normalised by the global
counts of the optimizer step, so the objective is the SUM of the local losses over microbatches
and ranks (data- and sequence-parallel: SP ranks hold disjoint tokens of the same sequences).
Gradients accumulate over microbatches by plain summation (with ``fsdp2.grad_reduce: step``
unsharded on each rank until the last microbatch's backward reduce-scatters their sum once; with
``microbatch`` each backward reduce-scatters into the summed sharded ``.grad``), and FSDP2's
reduce-scatter (and, under hybrid sharding, the all-reduce over replicas) AVERAGES them over all
``dp x sp`` ranks; multiplying each loss by the world size turns that average back into the sum.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import attrs
import torch

from unirl.backends.causal_lm import torch_dtype
from unirl.backends.fsdp2 import export, packed, weight_stream
from unirl.backends.fsdp2.engine import shard_model
from unirl.backends.fsdp2.plugin import Fsdp2Options
from unirl.backends.fsdp2.topology import Fsdp2Mesh
from unirl.backends.hf.model import PackedModule, Training
from unirl.backends.hf.optim import ScheduledLR, adamw
from unirl.core.backend import AdamStepSettings, OptimizerStepStats
from unirl.core.config.run_config import ModelConfig
from unirl.core.weights.stream import HOST, WeightBuckets

logger = logging.getLogger(__name__)


def _runner(device: torch.device, mesh: Fsdp2Mesh):
    sp_group = mesh.topology.groups.cp

    def run(module: Any, mb: Any) -> torch.Tensor:
        return packed.forward(module, mb, device, sp_group)

    return run


class Fsdp2Model(PackedModule):
    """Implements `unirl.backends.hf.model.TrainedModel` on `model` sharded over ``mesh``."""

    def __init__(
        self,
        model: torch.nn.Module,
        training: Training,
        *,
        model_cfg: ModelConfig,
        options: Fsdp2Options,
        mesh: Fsdp2Mesh,
        device: torch.device,
    ) -> None:
        sharded = shard_model(
            model, mesh.shard_mesh, options, dtype=model_cfg.dtype, device=device, train=True
        )
        super().__init__(sharded, device=device, run=_runner(device, mesh))
        self.optimizer, schedule = adamw(
            sharded, training.optimizer, total_steps=training.total_steps, key=training.key
        )
        if options.cpu_offload:
            # the Adam step runs on the host shards (CPUOffloadPolicy): torch's fused CPU
            # kernel, one pass over weight, gradient and moments, not foreach's ~18
            for group in self.optimizer.param_groups:
                group["fused"], group["foreach"] = True, False
        self.scheduler = ScheduledLR(self.optimizer, schedule)
        self.options = options
        self._grad_clip = training.optimizer.grad_clip
        self._model_cfg = model_cfg
        self._world_size = mesh.topology.world_size
        self._rank = mesh.topology.rank

    def train(self) -> None:
        self.module.train()

    def loss_scale(self, num_microbatches: int) -> float:
        """Cancels FSDP2's mean over all ``dp x sp`` ranks (see the module docstring); the
        microbatches' gradients are summed, so their number does not enter."""
        return float(self._world_size)

    def begin_microbatch(self, *, last: bool) -> None:
        """With ``fsdp2.grad_reduce: step`` only the last microbatch's backward reduces (and
        waits for the reduction); the others sum into the unsharded gradients."""
        if self.options.grad_reduce == "step":
            self.module.set_requires_gradient_sync(last)
            self.module.set_is_last_backward(last)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def set_step_settings(self, settings: AdamStepSettings) -> None:
        """`unirl.core.backend.TakesStepSettings`: the schedule stops deciding the LR; weight
        decay goes where ``adamw_param_groups`` decays (the groups built with a decay)."""
        self.scheduler.schedule = lambda _steps: settings.lr
        for group in self.optimizer.param_groups:
            group["lr"] = settings.lr
            group["betas"] = (settings.beta1, settings.beta2)
            group["eps"] = settings.eps
            if group.get(
                "decays", group["weight_decay"] > 0 or group is self.optimizer.param_groups[0]
            ):
                group["weight_decay"] = settings.weight_decay
        self._grad_clip = settings.grad_clip or None

    def optimizer_step(self) -> OptimizerStepStats:
        lr = float(self.optimizer.param_groups[0]["lr"])
        params = [p for p in self.module.parameters() if p.grad is not None]
        clip = self._grad_clip
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip else math.inf)
        if hasattr(norm, "full_tensor"):  # a DTensor: the norm over every shard
            norm = norm.full_tensor()
        grad_norm = float(norm)
        if not math.isfinite(grad_norm):
            logger.warning("non-finite gradient norm %s: optimizer step skipped", grad_norm)
            self.optimizer.zero_grad(set_to_none=True)
            return OptimizerStepStats(grad_norm=grad_norm, lr=lr, skipped=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return OptimizerStepStats(grad_norm=grad_norm, lr=lr)

    def export_hf(self, path: Path) -> None:
        dtype = torch_dtype(self._model_cfg)
        export.export_hf(self.module, self._model_cfg, dtype, Path(path), rank=self._rank)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The full weights in the model's dtype (collective)."""
        return export.hf_state_dict(self.module, torch_dtype(self._model_cfg))

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The trained parameters in their fp32 masters (collective)."""
        return export.trainable_state_dict(self.module)

    def stream_weights(
        self, bucket_bytes: int, *, dst: int | None, device: torch.device = HOST
    ) -> WeightBuckets:
        """One full parameter at a time in the model's dtype (collective)."""
        dtype = torch_dtype(self._model_cfg)
        return weight_stream.stream_weights(
            self.module, dtype, self.device, bucket_bytes, dst=dst, device=device
        )

    def non_finite_weight(self) -> str | None:
        return weight_stream.non_finite_weight(self.module, self.device)

    def close(self) -> None:
        super().close()
        self.optimizer = None  # type: ignore[assignment]


def frozen_model(
    model: torch.nn.Module,
    *,
    model_cfg: ModelConfig,
    options: Fsdp2Options,
    mesh: Fsdp2Mesh,
    device: torch.device,
) -> PackedModule:
    """The reference, sharded like the policy in its own dtype; with ``model.ref_offload`` its
    shards stay in CPU memory (FSDP2's offload policy moves each layer in for its forward)."""
    ref_options = attrs.evolve(options, cpu_offload=model_cfg.ref_offload)
    sharded = shard_model(
        model, mesh.shard_mesh, ref_options, dtype=model_cfg.dtype, device=device, train=False
    )
    return PackedModule(sharded, device=device, run=_runner(device, mesh))
