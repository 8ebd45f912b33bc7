"""PPO's critic on FSDP2: the Hugging Face one-label token classifier of
`unirl.backends.hf_model.load_critic` (the DeepSpeed and Megatron critics' initialisation),
sharded like the policy (``fully_shard`` per decoder layer, the same mesh, mixed precision and
offload), with its own AdamW and LR schedule (``critic.optimizer``). It runs the policy's packed
or Ulysses path; the loss is core's, scaled by the policy's factor (FSDP2 averages gradients over
all ``dp x sp`` ranks). ``critic.zero_stage`` does not apply (FSDP2 shards as ``fsdp2.sharding``
says; the config refuses it)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from unirl.backends.forward_only import forward_only
from unirl.backends.fsdp2 import export, packed
from unirl.backends.fsdp2.checkpoint import TrainedModel
from unirl.backends.fsdp2.engine import build_optimizer, shard_model
from unirl.backends.hf_model import load_critic, torch_dtype
from unirl.backends.microbatch import to_device, zero_through_graph
from unirl.core.backend import OptimizerStepStats, ValueLossFn
from unirl.core.data.microbatch import TrainMicrobatch
from unirl.core.maths.losses import Metric
from unirl.core.run.progress import MicrobatchProgress

if TYPE_CHECKING:
    from unirl.backends.fsdp2.backend import Fsdp2Backend


class Fsdp2Critic:
    """See the module docstring. Built by `Fsdp2Backend` when the config enables a critic."""

    def __init__(self, policy: Fsdp2Backend, *, total_optimizer_steps: int) -> None:
        cfg = policy.cfg
        self.cfg = cfg
        self.topology = policy.topology
        self.device = policy.device
        self._policy = policy
        model = load_critic(cfg.model, cfg.critic)
        packed.use_attention(model, policy.fsdp.sp)
        self.model = shard_model(
            model,
            policy._mesh.shard_mesh,
            policy.fsdp,
            dtype=cfg.model.dtype,
            device=self.device,
            train=True,
        )
        self.optimizer, self.scheduler = build_optimizer(
            self.model,
            cfg,
            total_steps=total_optimizer_steps,
            section=cfg.critic.optimizer,
            key="critic.optimizer",
        )
        self.forward_calls = 0

    @property
    def trained(self) -> TrainedModel:
        return TrainedModel(self.model, self.optimizer, self.scheduler)

    def _values(self, mb: TrainMicrobatch) -> tuple[torch.Tensor, torch.Tensor]:
        out = packed.forward(self.model, mb, self.device, self._policy._sp_group)  # [T, 1]
        self.forward_calls += 1
        values = out[:0, 0] if mb.num_tokens == 0 else out[:, 0]
        return values.float(), out

    def forward_values(
        self, microbatches: Sequence[TrainMicrobatch], *, progress: MicrobatchProgress
    ) -> list[torch.Tensor]:
        result = []
        with forward_only([self.model], device=self.device):
            for mb in microbatches:
                mb = to_device(mb, self.device)
                result.append(self._values(mb)[0])
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
        self.model.train()
        scale = self._policy.loss_scale(len(microbatches))
        metrics = []
        for mb in microbatches:
            mb = to_device(mb, self.device)
            values, out = self._values(mb)
            loss, mb_metrics = loss_fn(mb, values)
            if mb.num_tokens == 0:
                loss = loss + zero_through_graph(out)  # the same reduce-scatters on every rank
            (loss * scale).backward()
            metrics.append(mb_metrics)
            progress.report(loss=loss.detach(), tokens=mb.num_tokens)
            progress.tick()
        return metrics

    def optimizer_step(self) -> OptimizerStepStats:
        lr = float(self.optimizer.param_groups[0]["lr"])
        params = [p for p in self.model.parameters() if p.grad is not None]
        clip = self.cfg.critic.optimizer.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip else math.inf)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        grad_norm = float(norm)
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            return OptimizerStepStats(grad_norm=grad_norm, lr=lr, skipped=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return OptimizerStepStats(grad_norm=grad_norm, lr=lr)

    def export_hf(self, path: Path) -> None:
        export.export_hf(
            self.model,
            self.cfg.model,
            torch_dtype(self.cfg.model),
            Path(path),
            rank=self.topology.rank,
        )

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]
        self.optimizer = None  # type: ignore[assignment]
