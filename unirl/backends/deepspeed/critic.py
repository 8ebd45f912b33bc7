"""PPO's critic on DeepSpeed: a Hugging Face token-classification model with one label (the
policy's backbone + ``Linear(hidden, 1)``, `unirl.backends.hf_model.load_critic`) in its own
DeepSpeed engine: its own AdamW (``critic.optimizer``), LR schedule and ZeRO stage
(``critic.zero_stage``, default the policy's), on the policy's processes.

It runs packed microbatches exactly as the policy does (`forward_packed`, varlen attention) and
returns the per-token values ``[T]`` (column 0 of the head's output); the loss is core's
(`unirl.core.maths.losses.critic`), scaled by ``dp`` like the policy's (DeepSpeed averages
gradients over data-parallel ranks, the microbatches are summed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from unirl.backends.deepspeed import export
from unirl.backends.deepspeed.engine import initialize_trainable, step_engine
from unirl.backends.deepspeed.packed import forward_packed, use_packed_attention
from unirl.backends.forward_only import forward_only
from unirl.backends.hf_model import load_critic
from unirl.backends.microbatch import to_device, zero_through_graph
from unirl.core.backend import OptimizerStepStats, ValueLossFn
from unirl.core.data.microbatch import TrainMicrobatch
from unirl.core.maths.losses import Metric
from unirl.core.run.config import UnirlConfig
from unirl.core.run.progress import MicrobatchProgress
from unirl.core.topology import Topology


class DeepSpeedCritic:
    """See the module docstring. Built by `DeepSpeedBackend` when the config enables a critic."""

    def __init__(
        self,
        cfg: UnirlConfig,
        *,
        total_optimizer_steps: int,
        topology: Topology,
        rank: int,
    ) -> None:
        self.cfg = cfg
        self.topology = topology
        self._rank = rank
        model = load_critic(cfg.model, cfg.critic)
        use_packed_attention(model)
        stage = cfg.critic.zero_stage
        self.engine, self._scheduler = initialize_trainable(
            model,
            cfg,
            cfg.critic.optimizer,
            cfg.parallel.zero_stage if stage is None else stage,
            total_steps=total_optimizer_steps,
            dp_size=topology.dp_size,
            key="critic.optimizer",
        )
        self.device = torch.device(self.engine.device)
        self.forward_calls = 0  # model forwards, one per microbatch (the contract suite reads it)

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.module

    def loss_scale(self, num_microbatches: int) -> float:
        """As the policy's: cancels DeepSpeed's mean over data-parallel ranks."""
        return float(self.topology.dp_size)

    def _values(self, module: Any, mb: TrainMicrobatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values [T] fp32, raw head output)``; the output of an empty microbatch's pad token
        is returned for its zero loss."""
        out = forward_packed(module, mb, self.device)  # [T, 1]
        self.forward_calls += 1
        values = out[:0, 0] if mb.num_tokens == 0 else out[:, 0]
        return values.float(), out

    def forward_values(
        self, microbatches: Sequence[TrainMicrobatch], *, progress: MicrobatchProgress
    ) -> list[torch.Tensor]:
        result = []
        with forward_only([self.engine], device=self.device):
            for mb in microbatches:
                mb = to_device(mb, self.device)
                values, _ = self._values(self.engine, mb)
                result.append(values)
                progress.report(tokens=mb.num_tokens)
                progress.tick()
        return result

    def forward_backward(
        self,
        microbatches: Sequence[TrainMicrobatch],
        *,
        loss_fn: ValueLossFn,
        progress: MicrobatchProgress,
    ) -> list[Mapping[str, Metric]]:
        if not microbatches:
            raise ValueError("critic forward_backward got no microbatches (the plan gives one)")
        self.engine.train()
        metrics = []
        last = len(microbatches) - 1
        scale = self.loss_scale(len(microbatches))
        for i, mb in enumerate(microbatches):
            mb = to_device(mb, self.device)
            self.engine.set_gradient_accumulation_boundary(i == last)
            values, out = self._values(self.engine, mb)
            loss, mb_metrics = loss_fn(mb, values)
            if mb.num_tokens == 0:
                loss = loss + zero_through_graph(out)  # ZeRO's gradient hooks still fire
            self.engine.backward(loss * scale, scale_wrt_gas=False)
            metrics.append(mb_metrics)
            progress.report(loss=loss.detach(), tokens=mb.num_tokens)
            progress.tick()
        return metrics

    def optimizer_step(self) -> OptimizerStepStats:
        return step_engine(self.engine)

    def export_hf(self, path: Path) -> None:
        export.export_hf(self.engine, self.cfg.model, Path(path), rank=self._rank)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The full critic weights in Hugging Face names, on every rank (collective under
        ZeRO-3)."""
        return export.hf_state_dict(self.engine)

    def close(self) -> None:
        self.engine.destroy()
