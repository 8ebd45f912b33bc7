"""One model the Megatron backend holds: the policy, the reference or the critic.

Each is this rank's chunks of a megatron `GPTModel` (one per virtual pipeline stage, the same
layers and TP / PP / VPP / CP layout for every role) and a `Head` saying what its last stage
computes. A trained model (policy, critic) also has its own DDP, megatron optimizer and LR-schedule
position, from an `OptimizerPlan` (the policy's ``optimizer`` section, the critic's
``critic.optimizer``); a frozen one (the reference) has no gradients and may live on the CPU
between passes (``model.ref_offload``). The microbatch loop that runs any of them is `passes`.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from unirl.backends.kept_attention import keep_attention_in
from unirl.backends.megatron.checkpoint import ExtraModel
from unirl.backends.megatron.fused_head import emit_hidden
from unirl.backends.megatron.heads import Head, install_value_head
from unirl.backends.megatron.kernels.varlen_attention import probe_ahead
from unirl.backends.megatron.lora.install import LoraAdapters
from unirl.backends.megatron.lora.state import MergedParameters, adapter_state_dict
from unirl.backends.megatron.model import SDPACoreAttention, build_model_chunks
from unirl.backends.megatron.optimizer import (
    apply_schedule,
    apply_step_settings,
    build_optimizer,
    wrap_ddp,
)
from unirl.backends.megatron.schedule import schedule_config
from unirl.backends.megatron.sources import ModelSource
from unirl.backends.megatron.weights import stream as weight_stream
from unirl.backends.megatron.weights.hf_layout import (
    ParamsOf,
    export_hf_state_dict,
    load_hf_weights,
    own_parameters,
    save_hf,
)
from unirl.backends.megatron.weights_folder import MegatronWeights
from unirl.core.backend import AdamStepSettings, OptimizerStepStats
from unirl.core.config.derived import fused_head
from unirl.core.config.recompute_rules import refuse_experts
from unirl.core.config.run_config import OptimizerConfig, UnirlConfig
from unirl.core.errors import ConfigError
from unirl.core.run.lr_schedule import check_schedule
from unirl.core.topology import Topology
from unirl.core.weights.stream import HOST, WeightBuckets

logger = logging.getLogger(__name__)


def recompute_overrides(cfg: UnirlConfig, recompute: bool) -> dict[str, Any]:
    """Megatron's activation recompute for this model: ``recompute`` (the policy's
    ``model.gradient_checkpointing``) whole layers, one at a time (each keeps only its input and
    runs again in backward), or the first ``megatron.recompute_layers`` of each stage (block);
    otherwise ``megatron.recompute_modules`` selectively, or none."""
    options = cfg.backend_options
    if recompute and not cfg.model.recompute_attention:
        return {}  # unirl's checkpoint keeping attention instead (`keep_attention_layers`)
    if recompute:
        n = options.recompute_layers
        return {
            "recompute_granularity": "full",
            "recompute_method": "uniform" if n is None else "block",
            "recompute_num_layers": 1 if n is None else n,
        }
    if options.recompute_modules:
        return {
            "recompute_granularity": "selective",
            "recompute_modules": list(options.recompute_modules),
        }
    return {}


def build_chunks(
    source: ModelSource,
    cfg: UnirlConfig,
    topology: Topology,
    *,
    dtype: torch.dtype,
    recompute: bool = False,
    value_head: bool = False,
) -> list[torch.nn.Module]:
    """This rank's chunks with ``source``'s weights. ``recompute``: megatron's full activation
    recompute (``model.gradient_checkpointing``); ``value_head``: a critic's `ValueHead` in place
    of the output layer; otherwise ``model.fused_head`` makes the last stage emit hidden states."""
    overrides = schedule_config(cfg.parallel)
    overrides |= recompute_overrides(cfg, recompute)
    chunks = build_model_chunks(
        source.hf_config,
        cfg.parallel,
        dtype=dtype,
        config_overrides=overrides,
        unfused_attention=cfg.backend_options.attention == "unfused",
        experts_module=cfg.backend_options.experts,
    )
    if value_head:
        install_value_head(chunks, source.hf_config.hidden_size, dtype)
    if isinstance(source.weights, MegatronWeights):
        source.weights.load_into(chunks, cfg.parallel)
    else:
        load_hf_weights(chunks, source.weights, source.hf_config, topology)
    if fused_head(cfg) and not value_head:
        emit_hidden(chunks)
    if recompute and not cfg.model.recompute_attention:
        refuse_experts(source.hf_config.to_dict())  # the loaded model's config, checked again
        keep_attention_layers(chunks, cfg.backend_options.recompute_layers)
    return chunks


def keep_attention_layers(chunks: Sequence[torch.nn.Module], first: int | None) -> None:
    """``model.recompute_attention: false``: each chunk's layers (its ``first`` ones, as
    megatron's block recompute under ``megatron.recompute_layers``) checkpointed keeping their
    attention's output (`unirl.backends.kept_attention`), in place of megatron's full recompute.
    Only unirl's SDPA core attention runs kernels the checkpoint knows: Transformer Engine's and
    megatron's unfused attention would keep nothing, so they are refused."""
    for chunk in chunks:
        layers = list(chunk.decoder.layers)
        for layer in layers[: len(layers) if first is None else first]:
            core = layer.self_attention.core_attention
            if not isinstance(core, SDPACoreAttention):
                raise ConfigError(
                    f"model.recompute_attention: false keeps the outputs of torch's attention "
                    f"kernels; this model's core attention is {type(core).__name__} (megatron."
                    "attention: unfused, or Transformer Engine's), which runs none of them: use "
                    "megatron.attention: packed or padded without Transformer Engine, or remove "
                    "model.recompute_attention"
                )
            head_dim = layer.config.kv_channels
            keep_attention_in(layer, functools.partial(probe_ahead, head_dim=head_dim))


@attrs.frozen(kw_only=True)
class OptimizerPlan:
    """How one trained model is optimised; checked when made, before anything is built."""

    name: str  # "policy" / "critic": log messages and checkpoint entries
    key: str  # the config section, for error messages: "optimizer" / "critic.optimizer"
    section: OptimizerConfig
    total_steps: int  # optimizer steps of the run (the LR schedule's length)
    distributed: bool  # megatron's distributed optimizer (zero_stage 1)
    # master weights and Adam moments in host memory (`optimizer.build_optimizer`): the policy's
    # under optimizer.offload (`unirl.core.config.derived.optimizer_offload`), never the critic's
    offload_state: bool = False

    def __attrs_post_init__(self) -> None:
        check_schedule(self.section, self.total_steps, key=self.key)


class MegatronModel:
    """See the module docstring. ``plan`` None: frozen (``offload``: kept on the CPU).
    ``adapters``: the LoRA adapters installed on the chunks (`unirl.backends.megatron.lora`):
    the base is frozen, DDP and the optimizer hold the adapters only, and the exported / streamed
    weights are the merged ones."""

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        *,
        hf_config: Any,
        head: Head,
        cfg: UnirlConfig,
        topology: Topology,
        plan: OptimizerPlan | None,
        offload: bool = False,
        adapters: LoraAdapters | None = None,
    ) -> None:
        self.chunks = chunks
        self.adapters = adapters
        self.hf_config = hf_config
        self.head = head
        self.cfg = cfg
        self.topology = topology
        self.plan = plan
        self.offloaded = plan is None and offload
        self.ddp: list[Any] = []
        self.optimizer: Any = None
        self.steps_done = 0
        # set by the caller step by step (`TakesStepSettings`): then the schedule is not used
        self.step_settings: AdamStepSettings | None = None
        self.grads_pending = False  # a training pass ran since the last optimizer step
        if plan is None:
            for chunk in chunks:
                chunk.requires_grad_(False)
                chunk.eval()
                if self.offloaded:
                    chunk.to("cpu")
            return
        self.ddp = wrap_ddp(chunks, cfg, distributed=plan.distributed)
        self.optimizer = build_optimizer(
            self.ddp,
            cfg,
            optimizer=plan.section,
            distributed=plan.distributed,
            offload=plan.offload_state,
        )
        self.zero_grads()

    @property
    def modules(self) -> list[torch.nn.Module]:
        """What the schedule runs: the DDP-wrapped chunks of a trained model, else the chunks."""
        return self.ddp if self.plan is not None else self.chunks

    def zero_grads(self) -> None:
        for ddp in self.ddp:
            ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.grads_pending = False

    def apply_schedule(self) -> float:
        """The LR (and weight decay) of the next step written into the optimizer; returns it.
        Under `step_settings` the caller's (LR, betas, eps, weight decay, clip) instead."""
        assert self.plan is not None
        if self.step_settings is not None:
            return apply_step_settings(self.optimizer, self.step_settings)
        return apply_schedule(
            self.optimizer,
            self.cfg,
            self.steps_done,
            self.plan.total_steps,
            section=self.plan.section,
        )

    def optimizer_step(self) -> OptimizerStepStats:
        """Clip, step, advance the LR schedule; the norm is the global one before clipping."""
        assert self.plan is not None
        lr = self.apply_schedule()
        applied, grad_norm, _ = self.optimizer.step()
        norm = float(grad_norm) if grad_norm is not None else float("nan")
        if applied:
            self.steps_done += 1
        else:
            logger.warning("%s optimizer step skipped (gradient norm %s)", self.plan.name, norm)
        if not math.isfinite(norm):
            logger.warning("%s: non-finite gradient norm %s", self.plan.name, norm)
        self.zero_grads()
        return OptimizerStepStats(grad_norm=norm, lr=lr, skipped=not applied)

    def saved(self) -> ExtraModel:
        """What `checkpoint` saves and loads of this model."""
        return ExtraModel(self.ddp, self.optimizer, self.steps_done)

    def after_load(self, steps_done: int) -> None:
        """A checkpoint was loaded into the chunks and optimizer (`checkpoint`)."""
        self.steps_done = steps_done
        self.zero_grads()
        self.apply_schedule()

    def _params_of(self) -> ParamsOf:
        """How the export reads the weights: under LoRA merged (``W + scale * B @ A``)."""
        adapters = self.adapters
        if adapters is None:
            return own_parameters
        return lambda index, chunk: MergedParameters(chunk, adapters, index)

    def export_hf(self, path: Path) -> None:
        """A Hugging Face folder; under LoRA of the merged weights (the adapter alone:
        `export_adapter`)."""
        if self.adapters is not None:
            logger.info("exporting the policy with its LoRA adapter merged into %s", path)
        save_hf(Path(path), self.chunks, self.hf_config, self.topology, params_of=self._params_of())

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The full weights in Hugging Face names, on the CPU, on every rank (collective); under
        LoRA merged."""
        return export_hf_state_dict(self.chunks, self.hf_config, self.topology, self._params_of())

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter in PEFT names, whole, on every rank (collective)."""
        assert self.adapters is not None
        return adapter_state_dict(self.adapters, self.topology)

    def stream_weights(
        self,
        bucket_bytes: int,
        *,
        dst: int | None,
        device: torch.device = HOST,
        merged: bool = True,
    ) -> WeightBuckets:
        """`hf_state_dict`'s tensors in buckets on ``device``, from the stages that own them
        (collective); ``merged`` False: the base weights as they are (the adapter left out)."""
        return weight_stream.stream_weights(
            self.chunks,
            self.hf_config,
            self.topology,
            bucket_bytes,
            dst=dst,
            device=device,
            params_of=self._params_of() if merged else own_parameters,
        )

    def non_finite_weight(self) -> str | None:
        return weight_stream.non_finite_weight(self.chunks, self.hf_config, self._params_of())

    def close(self) -> None:
        self.optimizer = None
        self.ddp = []
        self.chunks = []
