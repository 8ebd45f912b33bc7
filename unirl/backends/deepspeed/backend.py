"""`DeepSpeedBackend`: unirl's `TrainingBackend` on DeepSpeed ZeRO 0-3 with Hugging Face models.

The passes, the reference and the critic are `unirl.backends.hf.backend.HFBackend`'s; this class
says how DeepSpeed starts (its communication, a data-parallel world), wraps a model for training
(`DeepSpeedModel`: one engine per trained model, ZeRO stage ``parallel.zero_stage``, the critic's
``critic.zero_stage``) or for frozen forwards (`DeepSpeedReference`), and checkpoints
(`unirl.backends.deepspeed.checkpoint`). Its loss scale is ``dp`` (`DeepSpeedModel.loss_scale`).
"""

from __future__ import annotations

from typing import Any

from unirl.backends.deepspeed import checkpoint
from unirl.backends.deepspeed.distributed import close_distributed, init_distributed
from unirl.backends.deepspeed.engine import initialize_reference
from unirl.backends.deepspeed.model import DeepSpeedModel, DeepSpeedReference
from unirl.backends.deepspeed.topology import deepspeed_topology
from unirl.backends.hf.backend import HFBackend
from unirl.backends.hf.model import Training
from unirl.backends.hf.packed import use_packed_attention
from unirl.backends.process_group import ProcessGroupSetup
from unirl.core.backend import AdamStepSettings
from unirl.core.topology import Topology


class DeepSpeedBackend(HFBackend):
    """See the module docstring."""

    checkpoints = checkpoint

    def _start(self) -> tuple[ProcessGroupSetup, Topology]:
        setup = init_distributed(self.cfg.parallel)
        return setup, deepspeed_topology(setup.rank, setup.world_size)

    def _use_attention(self, model: Any) -> None:
        use_packed_attention(model)

    def _trained(self, model: Any, training: Training) -> DeepSpeedModel:
        stage = self.cfg.critic.zero_stage if training.role == "critic" else None
        return DeepSpeedModel(
            model,
            self.cfg,
            training,
            zero_stage=self.cfg.parallel.zero_stage if stage is None else stage,
            dp_size=self.topology.dp_size,
            rank=self._dist.rank,
        )

    def _frozen(self, model: Any) -> DeepSpeedReference:
        cfg = self.cfg
        return DeepSpeedReference(
            initialize_reference(model, cfg, self.device, dp_size=self.topology.dp_size),
            device=self.device,
            offloaded=cfg.model.ref_offload and cfg.parallel.zero_stage != 3,
        )

    @property
    def engine(self) -> Any:
        """The policy's DeepSpeed engine."""
        return self.policy.engine

    def set_step_settings(self, settings: AdamStepSettings) -> None:
        """`unirl.core.backend.TakesStepSettings` (the policy's optimizer)."""
        self.policy.set_step_settings(settings)

    def _stop(self) -> None:
        close_distributed(self._dist)
