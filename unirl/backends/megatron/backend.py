"""`MegatronBackend`: unirl's `TrainingBackend` on megatron-core (TP, PP, VPP; DP with DDP and the
distributed optimizer) with a Hugging Face Llama / Qwen2 model.

One optimizer step, as core's RL step drives it::

    backend = MegatronBackend(cfg, total_optimizer_steps=n, needs_reference=kl_on)
    old = backend.forward_logprobs(mbs, role="policy", spec=spec, progress=bar)   # if recompute
    metrics = backend.forward_backward(mbs, loss_fn=loss_fn, spec=spec, progress=bar)
    stats = backend.optimizer_step()            # grad norm before clipping, lr used

Each microbatch runs through megatron's schedule for the layout (`schedule`) as one packed token
stream (`packed`: THD with varlen flash attention, context parallel included) or, with
``megatron.attention: padded | unfused``, as right-padded rows (`padded`); on the last pipeline stage the vocabulary-parallel logits of the real tokens
go to core's `token_logprobs` (TP all-reduces of per-token statistics only, never the full
vocabulary) and then to core's loss; with ``model.fused_head`` the last stage's hidden states and
the output layer's weight shard go to `token_logprobs_from_hidden` instead (`fused_head`). The only loss arithmetic here is `schedule.loss_scale`, the
factor that cancels megatron's mean over microbatches and data-parallel ranks.

On the CPU (gloo) the same megatron-core schedules, DDP and optimizer run, with the few
CUDA-only lines of megatron-core patched by `cpu_compat` (installed only when the device is the
CPU; on a GPU nothing is patched). Wherever Transformer Engine is absent, CPU or GPU, `te_compat`
binds the names megatron-core reads but only its TE import binds (the MoE router's gating).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from unirl.backends.base import EngineBackend, ForwardOnlyPass, TrainingPass
from unirl.backends.forward_only import forward_only
from unirl.backends.megatron import checkpoint, cpu_compat, schedule, te_compat
from unirl.backends.megatron.convert import export_hf_state_dict, load_hf_weights, save_hf
from unirl.backends.megatron.critic import MegatronCritic
from unirl.backends.megatron.fused_head import emit_hidden, head_weight
from unirl.backends.megatron.model import build_model_chunks
from unirl.backends.megatron.optimizer import apply_schedule, build_optimizer, wrap_ddp
from unirl.backends.megatron.schedule import (
    ScheduledMicrobatch,
    run_schedule,
    schedule_config,
    schedule_items,
)
from unirl.backends.megatron.topology import initialize_parallel_state, topology_from_parallel_state
from unirl.backends.microbatch import zero_through_graph
from unirl.backends.process_group import destroy_process_group, init_process_group
from unirl.core.backend import (
    LogprobSpec,
    OptimizerStepStats,
    token_logprobs,
    token_logprobs_from_hidden,
)
from unirl.core.critic import critic_optimizer_steps
from unirl.core.errors import ConfigError
from unirl.core.maths.losses import Metric
from unirl.core.run.config import UnirlConfig, critic_enabled
from unirl.core.run.lr_schedule import check_schedule

logger = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@attrs.frozen(kw_only=True)
class ModelSource:
    """Where a model's initial weights come from: an HF config and a local folder or state dict."""

    hf_config: Any
    weights: Any  # str (local safetensors folder) or Mapping[str, Tensor]


def policy_source(cfg: UnirlConfig) -> ModelSource:
    """``model.path``, or ``model.hf_config`` + ``init_seed`` built exactly as the DeepSpeed
    backend builds it (same seed -> same weights in both backends)."""
    from unirl.backends.megatron.hf_io import read_hf_config

    if cfg.model.path is not None:
        return ModelSource(hf_config=read_hf_config(cfg.model.path), weights=cfg.model.path)
    from unirl.backends.hf_model import build_from_config

    assert cfg.model.hf_config is not None  # the config checks one of the two is set
    model = build_from_config(cfg.model.hf_config, cfg.model.init_seed, torch.float32)
    return ModelSource(hf_config=model.config, weights=model.state_dict())


def reference_source(cfg: UnirlConfig) -> ModelSource:
    """``model.ref_path`` if set, else the policy's initial weights (reloaded from
    ``model.path`` or rebuilt from the same seed, so it never sees training)."""
    from unirl.backends.megatron.hf_io import read_hf_config

    if cfg.model.ref_path is not None:
        return ModelSource(
            hf_config=read_hf_config(cfg.model.ref_path, key="model.ref_path"),
            weights=cfg.model.ref_path,
        )
    return policy_source(cfg)


def _seed_model_parallel_rng(seed: int, device: torch.device) -> None:
    """megatron's tensor-parallel CUDA RNG tracker (used by its layers for dropout and
    recompute), seeded without moving the caller's default CUDA generator."""
    from megatron.core import tensor_parallel

    if device.type != "cuda" or tensor_parallel.get_cuda_rng_tracker().is_initialized():
        return
    with torch.random.fork_rng(devices=[device]):
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


class MegatronBackend(EngineBackend):
    """See the module docstring."""

    def __init__(
        self, cfg: UnirlConfig, *, total_optimizer_steps: int, needs_reference: bool = False
    ) -> None:
        super().__init__()
        check_schedule(cfg.optimizer, total_optimizer_steps)
        self.cfg = cfg
        self.total_optimizer_steps = total_optimizer_steps
        self.dtype = _DTYPES[cfg.model.dtype]
        self.packed = cfg.backend_options.attention == "packed"
        self._process_group = init_process_group(cfg.parallel)
        self.device = self._process_group.device
        if self.device.type == "cpu":
            cpu_compat.install()  # megatron-core's CUDA-only lines, on the CPU only
        te_compat.install()  # names megatron-core reads but only TE binds: wherever TE is absent
        initialize_parallel_state(cfg.parallel)
        self.topology = topology_from_parallel_state()
        _seed_model_parallel_rng(cfg.train.seed, self.device)
        source = policy_source(cfg)
        self.hf_config = source.hf_config
        self.vocab_size = int(self.hf_config.vocab_size)
        self.chunks = self._build_chunks(source, recompute=cfg.model.gradient_checkpointing)
        self._reference: list[torch.nn.Module] | None = None
        self._steps_done = 0
        self._grads_pending = False
        self._closed = False
        self.ddp: list[Any] = wrap_ddp(self.chunks, cfg)
        self.optimizer: Any = build_optimizer(self.ddp, cfg)
        self._zero_grads()
        if needs_reference:
            self._reference_chunks()
        self.critic: MegatronCritic | None = None
        if critic_enabled(cfg):
            self.critic = MegatronCritic(
                self, total_optimizer_steps=critic_optimizer_steps(cfg, total_optimizer_steps)
            )

    # -- building ----------------------------------------------------------------------------

    def _build_chunks(
        self, source: ModelSource, *, recompute: bool = False
    ) -> list[torch.nn.Module]:
        overrides = schedule_config(self.cfg.parallel)
        if recompute:
            # model.gradient_checkpointing: megatron's full activation recompute, one layer at a
            # time (keeps only each layer's input; recomputes the layer in backward)
            overrides |= {
                "recompute_granularity": "full",
                "recompute_method": "uniform",
                "recompute_num_layers": 1,
            }
        chunks = build_model_chunks(
            source.hf_config,
            self.cfg.parallel,
            dtype=self.dtype,
            config_overrides=overrides,
            unfused_attention=self.cfg.backend_options.attention == "unfused",
        )
        load_hf_weights(chunks, source.weights, source.hf_config, self.topology)
        if self.cfg.model.fused_head:
            emit_hidden(chunks)
        return chunks

    def _logprobs(
        self,
        chunks: list[torch.nn.Module],
        item: ScheduledMicrobatch,
        output: torch.Tensor,
        spec: LogprobSpec,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Core's log-probs of a microbatch from the last stage's output (``chunks``: this rank's
        unwrapped chunks of the model that ran): logits, or hidden states with the fused head."""
        assert item.mb is not None
        tp_group = self.topology.groups.tp if self.topology.tp_size > 1 else None
        rows = item.batch.real_logits(output)  # [T, V_local] logits or [T, H] hidden states
        if self.cfg.model.fused_head:
            weight = head_weight(chunks[-1])
            return token_logprobs_from_hidden(
                rows, weight, item.mb.targets, spec, tp_group=tp_group
            )
        return token_logprobs(rows, item.mb.targets, spec, tp_group=tp_group)

    def _reference_chunks(self) -> list[torch.nn.Module]:
        if self._reference is None:
            source = reference_source(self.cfg)
            if source.hf_config.vocab_size != self.vocab_size:
                raise ConfigError(
                    f"model.ref_path has vocab_size={source.hf_config.vocab_size}, the policy "
                    f"{self.vocab_size}; the reference must share the policy's tokenizer"
                )
            chunks = self._build_chunks(source)
            for chunk in chunks:
                chunk.requires_grad_(False)
                chunk.eval()
                if self.cfg.model.ref_offload:
                    chunk.to("cpu")
            self._reference = chunks
        return self._reference

    # -- properties --------------------------------------------------------------------------

    @property
    def model(self) -> list[torch.nn.Module]:
        """This rank's policy model chunks (megatron GPTModels, one per virtual stage)."""
        return self.chunks

    def loss_scale(self, num_microbatches: int) -> float:
        """The factor that cancels megatron's mean over microbatches and data-parallel ranks
        (`schedule.loss_scale`); ``num_microbatches`` counts the schedule's padding ones too."""
        return schedule.loss_scale(num_microbatches, self.topology)

    # -- forward passes ----------------------------------------------------------------------

    def _forward_logprobs(self, run: ForwardOnlyPass) -> list[torch.Tensor]:
        microbatches, role, spec, progress = run.microbatches, run.role, run.spec, run.progress
        if not microbatches:
            return []
        if role == "policy":
            model: list[torch.nn.Module] = list(self.ddp)
            chunks = self.chunks
        else:
            model = chunks = self._reference_chunks()
        offloaded = role == "reference" and self.cfg.model.ref_offload
        items, rows, seq_len = schedule_items(
            microbatches, self.topology, self.device, packed=self.packed
        )
        results: dict[int, torch.Tensor] = {}

        def loss_func(item: ScheduledMicrobatch, output: torch.Tensor) -> tuple[torch.Tensor, Any]:
            zero = torch.zeros((), device=self.device)
            if item.mb is None:
                return zero, {}
            logp, _ = self._logprobs(chunks, item, output, spec)
            results[item.index] = logp.detach().float()
            progress.report(tokens=item.mb.num_tokens)
            return zero, {}

        with forward_only(model, device=self.device, offloaded=offloaded):
            run_schedule(
                model,
                items,
                rows=rows,
                seq_len=seq_len,
                loss_func=loss_func,
                forward_only=True,
                topology=self.topology,
                on_forward=lambda: self._count_forward(role),
                on_microbatch=progress.tick,
            )
        if not self.topology.is_last_pipeline_stage():
            return []
        return [results[i] for i in range(len(microbatches))]

    def _forward_backward(self, run: TrainingPass) -> list[Mapping[str, Metric]]:
        """One schedule call: megatron reduces the gradients at its end, so all microbatches of
        one optimizer step come in one call."""
        microbatches, loss_fn, spec, progress = (
            run.microbatches,
            run.loss_fn,
            run.spec,
            run.progress,
        )
        if self._grads_pending:
            raise RuntimeError(
                "forward_backward called twice without optimizer_step: megatron's schedule "
                "reduces the gradients at the end of each call; pass all microbatches of one "
                "optimizer step in one call"
            )
        items, rows, seq_len = schedule_items(
            microbatches, self.topology, self.device, packed=self.packed
        )
        scale = self.loss_scale(len(items))
        metrics: dict[int, Mapping[str, Metric]] = {}

        def loss_func(item: ScheduledMicrobatch, output: torch.Tensor) -> tuple[torch.Tensor, Any]:
            # output: the last stage's logits, or its hidden states with the fused head
            if item.mb is None:  # VPP padding: a zero that still reaches every parameter
                return zero_through_graph(output), {}
            mb = item.mb
            logp, entropy = self._logprobs(self.chunks, item, output, spec)
            loss, mb_metrics = loss_fn(mb, logp, entropy)
            if mb.num_tokens == 0:
                # the backward (and the pipeline's gradient sends) run as for any microbatch
                loss = loss + zero_through_graph(output)
            metrics[item.index] = mb_metrics
            progress.report(loss=loss.detach(), tokens=mb.num_tokens)
            return loss * scale, {}

        for ddp in self.ddp:
            ddp.train()
        self._grads_pending = True
        run_schedule(
            self.ddp,
            items,
            rows=rows,
            seq_len=seq_len,
            loss_func=loss_func,
            forward_only=False,
            topology=self.topology,
            on_forward=lambda: self._count_forward("policy"),
            on_microbatch=progress.tick,
        )
        if not self.topology.is_last_pipeline_stage():
            return []
        return [metrics[i] for i in range(len(microbatches))]

    # -- optimizer ---------------------------------------------------------------------------

    def _zero_grads(self) -> None:
        for ddp in self.ddp:
            ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._grads_pending = False

    def optimizer_step(self) -> OptimizerStepStats:
        """Clip, step, advance the LR schedule; the norm is the global one before clipping."""
        lr = apply_schedule(self.optimizer, self.cfg, self._steps_done, self.total_optimizer_steps)
        applied, grad_norm, _ = self.optimizer.step()
        norm = float(grad_norm) if grad_norm is not None else float("nan")
        if applied:
            self._steps_done += 1
        else:
            logger.warning("optimizer step skipped (gradient norm %s)", norm)
        if not math.isfinite(norm):
            logger.warning("non-finite gradient norm %s", norm)
        self._zero_grads()
        return OptimizerStepStats(grad_norm=norm, lr=lr, skipped=not applied)

    # -- state -------------------------------------------------------------------------------

    def save_checkpoint(self, path: Path, client_state: Mapping[str, Any]) -> None:
        checkpoint.save_checkpoint(
            Path(path),
            self.ddp,
            self.optimizer,
            self.topology,
            client_state=client_state,
            steps_done=self._steps_done,
            extra=self._extra_models(),
        )

    def _extra_models(self) -> dict[str, checkpoint.ExtraModel]:
        if self.critic is None:
            return {}
        c = self.critic
        return {"critic": checkpoint.ExtraModel(c.ddp, c.optimizer, c.steps_done)}

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        client, self._steps_done, extra_steps = checkpoint.load_checkpoint(
            Path(path), self.ddp, self.optimizer, self.topology, extra=self._extra_models()
        )
        if self.critic is not None:
            self.critic.after_load(extra_steps["critic"])
        self._zero_grads()
        apply_schedule(self.optimizer, self.cfg, self._steps_done, self.total_optimizer_steps)
        return client

    def export_hf(self, path: Path) -> None:
        save_hf(Path(path), self.chunks, self.hf_config, self.topology)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The full policy weights in Hugging Face names, on the CPU, on every rank
        (collective: TP all-gathers and PP broadcasts)."""
        return export_hf_state_dict(self.chunks, self.hf_config, self.topology)

    def close(self) -> None:
        """Free the model and optimizer and megatron's parallel state; destroy the process group
        only if this backend created it."""
        if self._closed:
            return
        self._closed = True
        if self.critic is not None:
            self.critic.close()
        self.optimizer = None
        self.ddp = []
        self.chunks = []
        self._reference = None
        if dist.is_initialized():
            dist.barrier()
        ps.destroy_model_parallel()
        destroy_process_group(self._process_group)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
