"""The models a `DeepSpeedBackend` holds: `DeepSpeedModel`, one trained model in its own DeepSpeed
engine (the policy and the critic alike: own AdamW, LR schedule and ZeRO stage), and
`DeepSpeedReference`, the frozen reference. Both run packed microbatches through varlen attention
(`unirl.backends.hf.packed.forward_packed`).

The only loss arithmetic is `DeepSpeedModel.loss_scale`. Core losses are normalised by the global
counts of the optimizer step, so the objective is the SUM of the microbatch losses over
microbatches and data-parallel ranks. Gradients accumulate over microbatches by plain summation
(``scale_wrt_gas=False``), and DeepSpeed then AVERAGES them over the dp ranks; multiplying each
loss by ``dp`` turns that average back into the sum.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from unirl.backends.deepspeed import export, weight_stream
from unirl.backends.deepspeed.engine import initialize_trainable, step_engine
from unirl.backends.hf.model import PackedModule, Training
from unirl.backends.hf.packed import forward_packed
from unirl.core.backend import AdamStepSettings, OptimizerStepStats
from unirl.core.config.derived import optimizer_offload
from unirl.core.config.run_config import UnirlConfig
from unirl.core.weights.stream import HOST, WeightBuckets


def _runner(device: torch.device):
    def run(module: Any, mb: Any) -> torch.Tensor:
        return forward_packed(module, mb, device)

    return run


class DeepSpeedModel(PackedModule):
    """Implements `unirl.backends.hf.model.TrainedModel` on ``deepspeed.initialize`` of `model`."""

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: UnirlConfig,
        training: Training,
        *,
        zero_stage: int,
        dp_size: int,
        rank: int,
    ) -> None:
        engine, self.scheduler = initialize_trainable(
            model,
            cfg,
            training.optimizer,
            zero_stage,
            total_steps=training.total_steps,
            dp_size=dp_size,
            key=training.key,
            offload=training.role == "policy" and optimizer_offload(cfg),
        )
        if dp_size == 1 and zero_stage == 0:
            # One data-parallel rank: DeepSpeed would still flatten every gradient, all-reduce
            # it over a group of one and copy it back after each backward on the boundary.
            engine.enable_backward_allreduce = False
        device = torch.device(engine.device)
        super().__init__(engine, device=device, run=_runner(device))
        self.engine = engine
        self._model_cfg = cfg.model
        self._dp_size = dp_size
        self._rank = rank

    @property
    def hf_module(self) -> torch.nn.Module:
        """The Hugging Face module being trained (parameters partitioned under ZeRO-3)."""
        return self.engine.module

    def train(self) -> None:
        self.engine.train()

    def loss_scale(self, num_microbatches: int) -> float:
        """Cancels DeepSpeed's mean over data-parallel ranks (see the module docstring); the
        microbatches are summed (``scale_wrt_gas=False``), so their number does not enter."""
        return float(self._dp_size)

    def begin_microbatch(self, *, last: bool) -> None:
        # Reduce (ZeRO 0/1) / finish the partitioned reduction (ZeRO 2/3) on the last one.
        self.engine.set_gradient_accumulation_boundary(last)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def set_step_settings(self, settings: AdamStepSettings) -> None:
        """`unirl.core.backend.TakesStepSettings`: the schedule stops deciding the LR; weight
        decay goes to the first param group (``adamw_param_groups``' decayed matrices); the
        clip is read at each step by DeepSpeed's plain path (its config) and by every ZeRO /
        bf16 optimizer wrapper (its ``clip_grad``)."""
        self.scheduler.schedule = lambda _steps: settings.lr
        groups = self.engine.optimizer.param_groups
        for group in groups:
            group["lr"] = settings.lr
            group["betas"] = (settings.beta1, settings.beta2)
            group["eps"] = settings.eps
        groups[0]["weight_decay"] = settings.weight_decay
        self.engine._config.gradient_clipping = settings.grad_clip
        if hasattr(self.engine.optimizer, "clip_grad"):
            self.engine.optimizer.clip_grad = settings.grad_clip

    def optimizer_step(self) -> OptimizerStepStats:
        return step_engine(self.engine)

    def export_hf(self, path: Path) -> None:
        export.export_hf(self.engine, self._model_cfg, Path(path), rank=self._rank)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective under ZeRO-3."""
        return export.hf_state_dict(self.engine)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective under ZeRO-3."""
        return export.trainable_state_dict(self.engine)

    def stream_weights(
        self, bucket_bytes: int, *, dst: int | None, device: torch.device = HOST
    ) -> WeightBuckets:
        """Collective under ZeRO-3 (one gathered parameter at a time)."""
        return weight_stream.stream_weights(self.engine, bucket_bytes, dst=dst, device=device)

    def non_finite_weight(self) -> str | None:
        return weight_stream.non_finite_weight(self.engine)

    def close(self) -> None:
        self.engine.destroy()
        super().close()


class DeepSpeedReference(PackedModule):
    """The frozen reference: a ZeRO-3 inference engine under a ZeRO-3 policy, else the plain
    module (`unirl.backends.deepspeed.engine.initialize_reference`); with ``model.ref_offload``
    a plain module lives in CPU memory and moves in for each forward-only pass."""

    def __init__(self, module: Any, *, device: torch.device, offloaded: bool) -> None:
        super().__init__(module, device=device, run=_runner(device), offloaded=offloaded)

    def close(self) -> None:
        if hasattr(self.module, "destroy"):  # the ZeRO-3 engine
            self.module.destroy()
        super().close()
