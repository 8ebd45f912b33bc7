"""PPO's critic on megatron-core: the policy's GPTModel (same layers, same TP / PP / VPP / CP
layout and schedules) whose output layer is a value head, ``Linear(hidden, 1)``, in its own DDP
and optimizer (``critic.optimizer``; ``critic.zero_stage: 1`` = the distributed optimizer).

The head is whole on every tensor-parallel rank: the hidden states reaching it are whole there
(no sequence parallel), so each rank computes the same values and the same head gradient, and
megatron's gradient norm counts the head once (its parameters carry no ``tensor_model_parallel``
mark). Weights in and out are Hugging Face's ``*ForTokenClassification`` with one label
(`unirl.backends.hf_model.load_critic`, the DeepSpeed critic's exact initialisation), converted by
`convert` (``score`` <-> ``output_layer.value``). The loss is core's; the only factor here is the
policy's `schedule.loss_scale`.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from unirl.backends.forward_only import forward_only
from unirl.backends.megatron import schedule
from unirl.backends.megatron.convert import load_hf_weights, save_hf
from unirl.backends.megatron.model import build_model_chunks
from unirl.backends.megatron.optimizer import apply_schedule, build_optimizer, wrap_ddp
from unirl.backends.megatron.schedule import (
    ScheduledMicrobatch,
    run_schedule,
    schedule_config,
    schedule_items,
)
from unirl.backends.microbatch import zero_through_graph
from unirl.core.backend import OptimizerStepStats, ValueLossFn
from unirl.core.data.microbatch import TrainMicrobatch
from unirl.core.maths.losses import Metric
from unirl.core.run.lr_schedule import check_schedule
from unirl.core.run.progress import MicrobatchProgress

if TYPE_CHECKING:
    from unirl.backends.megatron.backend import MegatronBackend

logger = logging.getLogger(__name__)


class ValueHead(torch.nn.Module):
    """Stands in for GPTModel's output layer: ``[s, b, h] -> ([s, b, 1], None)``; megatron passes
    the (untied) output weight and gather flag, which a value head does not use."""

    is_value_head = True  # `convert` maps its weight and bias to HF's ``score``

    def __init__(self, hidden: int, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        # megatron's checkpointing reads output_layer.weight by that name
        self.weight = torch.nn.Parameter(torch.empty(1, hidden, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.empty(1, dtype=dtype, device=device))

    def forward(
        self, hidden: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None
    ) -> tuple[torch.Tensor, None]:
        return torch.nn.functional.linear(hidden, self.weight, self.bias), None


def critic_hf_config(model: Any) -> Any:
    """The HF config the critic's chunks are built and exported with: untied (the head is not
    the embedding), ``architectures`` naming the token classifier."""
    config = copy.deepcopy(model.config)
    config.tie_word_embeddings = False
    return config


class MegatronCritic:
    """See the module docstring. Built by `MegatronBackend` when the config enables a critic."""

    def __init__(self, policy: MegatronBackend, *, total_optimizer_steps: int) -> None:
        from unirl.backends.hf_model import load_critic

        cfg = policy.cfg
        check_schedule(cfg.critic.optimizer, total_optimizer_steps, key="critic.optimizer")
        self.cfg = cfg
        self.topology = policy.topology
        self.device = policy.device
        self.total_optimizer_steps = total_optimizer_steps
        self.packed = policy.packed
        hf_model = load_critic(cfg.model, cfg.critic)
        self.hf_config = critic_hf_config(hf_model)
        weights = {k: v.detach() for k, v in hf_model.state_dict().items()}
        del hf_model
        self.chunks = build_model_chunks(
            self.hf_config,
            cfg.parallel,
            dtype=policy.dtype,
            config_overrides=schedule_config(cfg.parallel),
            unfused_attention=cfg.backend_options.attention == "unfused",
        )
        for chunk in self.chunks:
            if chunk.post_process:
                device = next(chunk.parameters()).device
                chunk.output_layer = ValueHead(
                    self.hf_config.hidden_size, dtype=policy.dtype, device=device
                )
        load_hf_weights(self.chunks, weights, self.hf_config, self.topology)
        stage = cfg.critic.zero_stage
        self.distributed = (cfg.parallel.zero_stage if stage is None else stage) == 1
        self.ddp: list[Any] = wrap_ddp(self.chunks, cfg, distributed=self.distributed)
        self.optimizer: Any = build_optimizer(
            self.ddp, cfg, optimizer=cfg.critic.optimizer, distributed=self.distributed
        )
        self.steps_done = 0
        self.forward_calls = 0
        self._zero_grads()

    @property
    def model(self) -> list[torch.nn.Module]:
        return self.chunks

    def _values_of(self, item: ScheduledMicrobatch, output: torch.Tensor) -> torch.Tensor:
        return item.batch.real_logits(output)[:, 0].float()  # [T, 1] -> [T]

    def _count(self) -> None:
        self.forward_calls += 1

    def forward_values(
        self, microbatches: Sequence[TrainMicrobatch], *, progress: MicrobatchProgress
    ) -> list[torch.Tensor]:
        if not microbatches:
            return []
        items, rows, seq_len = schedule_items(
            microbatches, self.topology, self.device, packed=self.packed
        )
        results: dict[int, torch.Tensor] = {}

        def loss_func(item: ScheduledMicrobatch, output: torch.Tensor) -> tuple[torch.Tensor, Any]:
            zero = torch.zeros((), device=self.device)
            if item.mb is None:
                return zero, {}
            results[item.index] = self._values_of(item, output).detach()
            progress.report(tokens=item.mb.num_tokens)
            return zero, {}

        with forward_only(self.ddp, device=self.device):
            run_schedule(
                self.ddp,
                items,
                rows=rows,
                seq_len=seq_len,
                loss_func=loss_func,
                forward_only=True,
                topology=self.topology,
                on_forward=self._count,
                on_microbatch=progress.tick,
            )
        if not self.topology.is_last_pipeline_stage():
            return []
        return [results[i] for i in range(len(microbatches))]

    def forward_backward(
        self,
        microbatches: Sequence[TrainMicrobatch],
        *,
        loss_fn: ValueLossFn,
        progress: MicrobatchProgress,
    ) -> list[Mapping[str, Metric]]:
        if not microbatches:
            raise ValueError("critic forward_backward got no microbatches (the plan gives one)")
        items, rows, seq_len = schedule_items(
            microbatches, self.topology, self.device, packed=self.packed
        )
        scale = schedule.loss_scale(len(items), self.topology)
        metrics: dict[int, Mapping[str, Metric]] = {}

        def loss_func(item: ScheduledMicrobatch, output: torch.Tensor) -> tuple[torch.Tensor, Any]:
            if item.mb is None:  # VPP padding
                return zero_through_graph(output), {}
            loss, mb_metrics = loss_fn(item.mb, self._values_of(item, output))
            if item.mb.num_tokens == 0:
                loss = loss + zero_through_graph(output)
            metrics[item.index] = mb_metrics
            progress.report(loss=loss.detach(), tokens=item.mb.num_tokens)
            return loss * scale, {}

        for ddp in self.ddp:
            ddp.train()
        run_schedule(
            self.ddp,
            items,
            rows=rows,
            seq_len=seq_len,
            loss_func=loss_func,
            forward_only=False,
            topology=self.topology,
            on_forward=self._count,
            on_microbatch=progress.tick,
        )
        if not self.topology.is_last_pipeline_stage():
            return []
        return [metrics[i] for i in range(len(microbatches))]

    def _zero_grads(self) -> None:
        for ddp in self.ddp:
            ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def apply_schedule(self) -> float:
        return apply_schedule(
            self.optimizer,
            self.cfg,
            self.steps_done,
            self.total_optimizer_steps,
            section=self.cfg.critic.optimizer,
        )

    def optimizer_step(self) -> OptimizerStepStats:
        lr = self.apply_schedule()
        applied, grad_norm, _ = self.optimizer.step()
        norm = float(grad_norm) if grad_norm is not None else float("nan")
        if applied:
            self.steps_done += 1
        else:
            logger.warning("critic optimizer step skipped (gradient norm %s)", norm)
        if not math.isfinite(norm):
            logger.warning("critic: non-finite gradient norm %s", norm)
        self._zero_grads()
        return OptimizerStepStats(grad_norm=norm, lr=lr, skipped=not applied)

    def after_load(self, steps_done: int) -> None:
        """A checkpoint was loaded into the chunks and optimizer (`checkpoint`)."""
        self.steps_done = steps_done
        self._zero_grads()
        self.apply_schedule()

    def export_hf(self, path: Path) -> None:
        save_hf(Path(path), self.chunks, self.hf_config, self.topology)

    def close(self) -> None:
        self.optimizer = None
        self.ddp = []
        self.chunks = []
