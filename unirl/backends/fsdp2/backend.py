"""`Fsdp2Backend`: unirl's `TrainingBackend` on PyTorch FSDP2 (`fully_shard`) with Hugging Face
models, optionally with Ulysses sequence parallel.

The passes, the reference and the critic are `unirl.backends.hf.backend.HFBackend`'s; this class
says how FSDP2 starts (the process group and the ``(dp, sp)`` device mesh), wraps a model for
training (`Fsdp2Model`: sharded on the mesh, own AdamW; the critic shards like the policy, and
``critic.zero_stage`` does not apply, the config refuses it) or for frozen forwards
(`frozen_model`; ``optimizer.offload`` puts the policy's shards, gradients and optimizer
state in host memory with FSDP2's CPUOffloadPolicy), and checkpoints (DCP, `unirl.backends.fsdp2.checkpoint`). Its loss scale is the
world size (`Fsdp2Model.loss_scale`).
"""

from __future__ import annotations

from typing import Any

import attrs

from unirl.backends.fsdp2 import checkpoint, packed
from unirl.backends.fsdp2.model import Fsdp2Model, frozen_model
from unirl.backends.fsdp2.plugin import Fsdp2Options
from unirl.backends.fsdp2.topology import build_mesh
from unirl.backends.hf.backend import HFBackend
from unirl.backends.hf.model import PackedModule, Training
from unirl.backends.process_group import (
    ProcessGroupSetup,
    destroy_process_group,
    init_process_group,
)
from unirl.core.backend import AdamStepSettings
from unirl.core.config.derived import optimizer_offload
from unirl.core.topology import Topology


class Fsdp2Backend(HFBackend):
    """See the module docstring."""

    checkpoints = checkpoint

    def _start(self) -> tuple[ProcessGroupSetup, Topology]:
        self.fsdp: Fsdp2Options = self.cfg.backend_options
        setup = init_process_group(self.cfg.parallel)
        self._mesh = build_mesh(self.fsdp, setup.rank, setup.world_size, setup.device)
        return setup, self._mesh.topology

    def _use_attention(self, model: Any) -> None:
        packed.use_attention(model, self.fsdp.sp)

    def _placement(self) -> dict[str, Any]:
        return {
            "model_cfg": self.cfg.model,
            "options": self.fsdp,
            "mesh": self._mesh,
            "device": self._dist.device,
        }

    def _trained(self, model: Any, training: Training) -> Fsdp2Model:
        """Sharded on the mesh; the policy under ``optimizer.offload`` (`optimizer_offload`)
        with FSDP2's CPUOffloadPolicy, as ``fsdp2.cpu_offload: true``."""
        placement = self._placement()
        if training.role == "policy" and optimizer_offload(self.cfg):
            placement["options"] = attrs.evolve(self.fsdp, cpu_offload=True)
        return Fsdp2Model(model, training, **placement)

    def _frozen(self, model: Any) -> PackedModule:
        return frozen_model(model, **self._placement())

    def set_step_settings(self, settings: AdamStepSettings) -> None:
        """`unirl.core.backend.TakesStepSettings` (the policy's optimizer)."""
        self.policy.set_step_settings(settings)

    def _stop(self) -> None:
        destroy_process_group(self._dist)
