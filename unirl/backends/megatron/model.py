"""Megatron-core `GPTModel` built from a Hugging Face Llama / Qwen2 / Qwen3 / Qwen3-MoE config.

The architecture is read from the HF config (RMSNorm, SwiGLU, RoPE with its base and Llama-3
scaling, GQA, tied or untied embeddings, Qwen2's qkv bias, Qwen3's per-head q/k RMSNorm,
Qwen3-MoE's routed experts: `unirl.backends.megatron.moe.layers`); the weights come afterwards from
`unirl.backends.megatron.weights.hf_layout.load_hf_weights` (the init is skipped: every parameter is
overwritten). Build after `initialize_parallel_state`; one model chunk per virtual pipeline stage::

    initialize_parallel_state(parallel)
    chunks = build_model_chunks(hf_config, parallel, dtype=torch.bfloat16)
    load_hf_weights(chunks, "/models/qwen2.5-0.5b", hf_config, topology_from_parallel_state())

Layer spec: Transformer Engine's when TE is importable, else megatron's local spec with its core
attention replaced by `SDPACoreAttention` (PyTorch SDPA). megatron-core 0.16.1's local
`DotProductAttention` cannot run on the CPU (it allocates its score buffer and its causal mask on
CUDA and forks the CUDA RNG tracker) and is unfused on GPUs; SDPA runs on both and uses the
flash / memory-efficient kernels on GPUs without flash-attn. The same module also takes packed
(THD) sequences, with or without context parallel, through `varlen_attention` (inputs built by
`unirl.backends.megatron.packed.packed_model_inputs`), so context parallel needs no Transformer
Engine; padded batches run with cp == 1 only.

Outputs: with ``parallel_output=True`` the last chunk returns vocabulary-parallel logits
``[B, S, V_padded / tp]`` (batch-first: GPTModel transposes back when no labels are given);
other chunks return hidden states ``[S, B, H]``.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from unirl.backends.megatron.compat import te as te_compat
from unirl.backends.megatron.compat.sequence_parallel import (
    sequence_parallel_block,
    sequence_parallel_norms,
)
from unirl.backends.megatron.compat.te import te_available
from unirl.backends.megatron.kernels import gpu_fusions, multi_tensor, wgrad_fusion
from unirl.backends.megatron.kernels.varlen_attention import (
    cp_packed_causal_attention,
    packed_causal_attention,
)
from unirl.backends.megatron.moe.grouped_dispatch import GroupedMoELayer
from unirl.backends.megatron.moe.grouped_experts import (
    ExpertsChoice,
    GroupedExperts,
    experts_spec,
    select_experts,
)
from unirl.backends.megatron.moe.layers import (
    RecordingTopKRouter,
    check_moe_config,
    is_moe,
    moe_transformer_fields,
)
from unirl.backends.megatron.weights.hf_layout import attention_dims, padded_vocab_size
from unirl.core.config.run_config import ParallelConfig
from unirl.core.errors import ConfigError

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
# RMSNorm on each query / key head (over head_dim) before RoPE: megatron's qk_layernorm
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")
# Megatron-LM's default for --make-vocab-size-divisible-by.
VOCAB_DIVISIBLE_BY = 128
# megatron-core implements Llama-3 RoPE scaling with these constants fixed.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
_LLAMA3_ORIGINAL_MAX = 8192


# --- the HF config, read and checked ----------------------------------------------------------


def _rope_parameters(hf_config: Any) -> dict[str, Any]:
    """RoPE settings from either transformers 5 (``rope_parameters``) or 4 (``rope_theta`` +
    ``rope_scaling``)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    params = {**scaling, **params}
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def rope_settings(hf_config: Any) -> dict[str, Any]:
    """``rotary_base`` / ``rope_scaling`` / ``rope_scaling_factor`` for `GPTModel`."""
    rope = _rope_parameters(hf_config)
    kind = rope["rope_type"]
    if kind == "default":
        return {"rotary_base": rope["rope_theta"], "rope_scaling": False}
    if kind == "llama3":
        fixed = {k: float(rope.get(k, v)) for k, v in _LLAMA3_FIXED.items()}
        original = int(rope.get("original_max_position_embeddings", _LLAMA3_ORIGINAL_MAX))
        if fixed == _LLAMA3_FIXED and original == _LLAMA3_ORIGINAL_MAX:
            return {
                "rotary_base": rope["rope_theta"],
                "rope_scaling": True,
                "rope_scaling_factor": float(rope["factor"]),
            }
    raise ConfigError(
        f"model.hf_config.rope_scaling (rope_parameters) = {rope!r} is not supported by the "
        "Megatron backend: it implements plain RoPE and Llama-3 scaling with low_freq_factor=1, "
        "high_freq_factor=4, original_max_position_embeddings=8192 only; use a model with one of "
        "those or backend: deepspeed"
    )


def check_hf_config(hf_config: Any, parallel: ParallelConfig) -> None:
    """Reject what the Megatron model or the weight conversion does not reproduce exactly."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"model.hf_config.model_type={model_type!r} is not supported by the Megatron backend; "
            f"supported: {list(SUPPORTED_MODEL_TYPES)} (or use backend: deepspeed)"
        )
    if hf_config.hidden_act != "silu":
        raise ConfigError(
            f"model.hf_config.hidden_act={hf_config.hidden_act!r}: the Megatron backend builds "
            "SwiGLU MLPs only; hidden_act must be 'silu'"
        )
    for key in ("attention_bias", "mlp_bias"):
        if getattr(hf_config, key, False):
            raise ConfigError(
                f"model.hf_config.{key}=True is not supported by the Megatron backend (only "
                "Qwen2's q/k/v bias is); set it to false or use backend: deepspeed"
            )
    if getattr(hf_config, "use_sliding_window", False):
        raise ConfigError(
            "model.hf_config.use_sliding_window=True is not supported by the Megatron backend; "
            "set it to false or use backend: deepspeed"
        )
    dims = attention_dims(hf_config)
    heads, groups = dims["num_heads"], dims["num_query_groups"]
    if heads % groups:
        raise ConfigError(
            f"model.hf_config.num_attention_heads={heads} is not divisible by "
            f"num_key_value_heads={groups}"
        )
    if groups % parallel.tp:
        raise ConfigError(
            f"parallel.tp={parallel.tp} does not divide model.hf_config.num_key_value_heads="
            f"{groups}: each tensor-parallel rank must hold whole key/value heads; choose a tp "
            "that divides the number of key/value heads"
        )
    if is_moe(hf_config):
        check_moe_config(hf_config, parallel)
    elif parallel.ep > 1 or parallel.etp is not None:
        raise ConfigError(
            f"parallel.ep={parallel.ep}, parallel.etp={parallel.etp} need a mixture-of-experts "
            f"model; model.hf_config.model_type={model_type!r} is dense: set parallel.ep: 1 and "
            "leave parallel.etp unset"
        )
    if hf_config.intermediate_size % parallel.tp:
        raise ConfigError(
            f"parallel.tp={parallel.tp} does not divide model.hf_config.intermediate_size="
            f"{hf_config.intermediate_size}"
        )
    stages = parallel.pp * (parallel.vpp or 1)
    if hf_config.num_hidden_layers % stages:
        raise ConfigError(
            f"model.hf_config.num_hidden_layers={hf_config.num_hidden_layers} is not divisible "
            f"by parallel.pp x parallel.vpp = {parallel.pp} x {parallel.vpp or 1}"
        )
    rope_settings(hf_config)


def transformer_config(
    hf_config: Any, parallel: ParallelConfig, *, dtype: torch.dtype, **overrides: Any
) -> TransformerConfig:
    """The `TransformerConfig` of the HF architecture under ``parallel``.

    ``overrides`` are further TransformerConfig fields (recompute, variable_seq_lengths ...).
    Dropout is off (RL fine-tuning; and the SDPA attention has no TP-aware dropout RNG).
    """
    check_hf_config(hf_config, parallel)
    dims = attention_dims(hf_config)
    fields: dict[str, Any] = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=dims["num_query_groups"],
        kv_channels=dims["head_dim"],
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=hf_config.model_type == "qwen2",
        qk_layernorm=hf_config.model_type in QK_NORM_MODEL_TYPES,
        # HF's rotate_half convention: the two halves of each head, not interleaved pairs
        rotary_interleaved=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # SwiGLU in one fused kernel (megatron's bias_swiglu, compiled by torch.compile through
        # its jit_fuser; needs neither TE nor Apex): one pass over the [T, 2 * ffn] activation
        # instead of three
        bias_activation_fusion=True,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        context_parallel_size=parallel.cp,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        # weights are loaded right after the build: skip the (slow, discarded) random init
        perform_initialization=False,
        use_cpu_initialization=not torch.cuda.is_available(),
    )
    if is_moe(hf_config):
        fields.update(moe_transformer_fields(hf_config, parallel))
    fields.update(overrides)
    return TransformerConfig(**fields)


# --- attention and host fixes ----------------------------------------------------------------


class SDPACoreAttention(MegatronModule):
    """Megatron's core-attention slot filled by PyTorch attention kernels, for two input formats.

    **Padded** (``packed_seq_params`` None): ``query [Sq, B, heads, D]``, ``key`` / ``value
    [Sk, B, groups, D]`` (GQA: each group serves ``heads / groups`` consecutive query heads, as
    `repeat_interleave` and SDPA's ``enable_gqa`` both assume); output ``[Sq, B, heads * D]``,
    by `torch.nn.functional.scaled_dot_product_attention`. With no mask it is causal; a mask given
    follows Megatron's convention (True = masked out). No context parallel.

    **Packed** (``packed_seq_params.qkv_format == "thd"``, see `unirl.backends.megatron.packed`):
    ``SelfAttention`` has applied RoPE (at the global positions) and squeezed q/k/v to
    ``[T_local, heads, D]``; causal attention within each packed sequence by
    `packed_causal_attention` (cp == 1) or `cp_packed_causal_attention` (cp > 1: keys / values
    all-gathered over the CP group); output ``[T_local, heads * D]`` (SelfAttention reshapes it
    to ``[T_local, 1, heads * D]``).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        assert dropout == 0.0, "SDPACoreAttention has no tensor-parallel dropout RNG"
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        )
        self.cp_size = config.context_parallel_size
        cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if cp_group is None and self.cp_size > 1:
            cp_group = ps.get_context_parallel_group()
        self.cp_group = cp_group

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention has no attention bias")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        if self.cp_size > 1:
            raise NotImplementedError(
                f"context_parallel_size={self.cp_size} needs packed (THD) inputs: pass "
                "packed_seq_params from unirl.backends.megatron.packed.packed_model_inputs"
            )
        mask_type = attn_mask_type or self.attn_mask_type
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [B, heads, S, D]
        causal = attention_mask is None and mask_type == AttnMaskType.causal
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=None if attention_mask is None else ~attention_mask,
            is_causal=causal,
            scale=self.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _packed(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: Any
    ) -> torch.Tensor:
        if params.qkv_format != "thd":
            raise NotImplementedError(
                f"SDPACoreAttention: packed_seq_params.qkv_format={params.qkv_format!r}; only "
                "'thd' is supported"
            )
        if self.cp_size == 1:
            bounds = params.cu_seqlens_q_padded
            bounds = params.cu_seqlens_q if bounds is None else bounds
            cu = getattr(params, "cu_seqlens_device", None)  # unirl's params: on query's device
            cu = bounds.to(query.device) if cu is None else cu
            out = packed_causal_attention(
                query,
                key,
                value,
                cu,
                scale=self.softmax_scale,
                longest_seq=params.max_seqlen_q,
                # read from the host copy: no sync
                total_tokens=None if bounds.is_cuda else int(bounds[-1]),
            )
        else:
            layout = getattr(params, "cp_layout", None)
            if layout is None or layout.cp_size != self.cp_size:
                raise NotImplementedError(
                    f"context_parallel_size={self.cp_size}: packed_seq_params must carry the "
                    "microbatch's CP layout (build it with "
                    "unirl.backends.megatron.packed.packed_model_inputs)"
                )
            out = cp_packed_causal_attention(
                query,
                key,
                value,
                layout,
                self.cp_group,
                scale=self.softmax_scale,
                index=params.cp_index,
            )
        return out.reshape(out.shape[0], -1)


class _HostRotaryEmbedding(RotaryEmbedding):
    """megatron-core 0.16.1's `RotaryEmbedding.get_emb` moves ``inv_freq`` to CUDA
    unconditionally; on a host without CUDA it stays on the CPU (same computation otherwise)."""

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(
                freqs.shape[0], -1
            )
        return emb[:, None, None, :]


class UnirlGPTModel(GPTModel):
    """`GPTModel` that also builds and runs on hosts without CUDA (the CPU test tier).

    megatron-core 0.16.1 moves the last stage's copy of tied embeddings to CUDA before the
    all-reduce that makes it equal the first stage's; without CUDA that all-reduce runs on the
    host tensor. Behaviour with CUDA is GPTModel's, unchanged.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not torch.cuda.is_available() and isinstance(
            getattr(self, "rotary_pos_emb", None), RotaryEmbedding
        ):
            self.rotary_pos_emb.__class__ = _HostRotaryEmbedding

    def setup_embeddings_and_output_layer(self) -> None:
        if torch.cuda.is_available():
            super().setup_embeddings_and_output_layer()
            return
        in_group = self._is_in_embd_group()
        self._is_in_embd_group = lambda: False  # skip the parent's CUDA all-reduce
        try:
            super().setup_embeddings_and_output_layer()
        finally:
            del self._is_in_embd_group
        tied_across_stages = (
            self.share_embeddings_and_output_weights
            and self.config.pipeline_model_parallel_size > 1
        )
        if tied_across_stages and in_group and dist.is_initialized():
            dist.all_reduce(self.shared_embedding_or_output_weight().data, group=self.embd_group)


def layer_spec(
    *, use_te: bool | None = None, unfused_attention: bool = False, qk_layernorm: bool = False
) -> ModuleSpec:
    """Transformer Engine's layer spec when TE is importable, else the local spec with SDPA
    (``unfused_attention``: the local spec as megatron-core ships it, for comparison; padded
    input on CUDA only)."""
    if unfused_attention:
        return get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm)
    if use_te if use_te is not None else te_available():
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm)
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


def moe_block_spec(
    config: TransformerConfig,
    *,
    vp_stage: int | None,
    device: torch.device,
    use_te: bool | None = None,
    unfused_attention: bool = False,
    experts_module: str = "auto",
) -> TransformerBlockSubmodules:
    """The layers of this (virtual) stage of a mixture-of-experts model, dense or MoE as
    ``config.moe_layer_freq`` says: megatron's block spec, with `SDPACoreAttention` (unless
    ``unfused_attention`` or TE), routers that record their logits (`RecordingTopKRouter`) and
    the experts `spec_experts` picks (without TE `GroupedExperts` on CUDA with
    ``torch._grouped_mm``, megatron's `SequentialMLP` on the CPU: same parameters, so checkpoints
    and the Hugging Face conversion do not depend on the choice; with TE, TE's own unless
    ``experts_module`` names one); with grouped experts the layer is `GroupedMoELayer` (its
    dispatcher keeps the token counts on the device)."""
    te = use_te if use_te is not None else te_available()
    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=te, normalization="RMSNorm", vp_stage=vp_stage
    )
    experts = spec_experts(device, config, experts_module, te=te)
    for spec in block.layer_specs:
        if not (te or unfused_attention):
            spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
        mlp = spec.submodules.mlp
        if isinstance(mlp, ModuleSpec) and mlp.module is MoELayer:
            mlp.submodules.router = RecordingTopKRouter
            if experts is not None:
                mlp.submodules.experts = experts_spec(experts)
                if experts.module is GroupedExperts:
                    # the all-to-all dispatcher without host syncs where no token leaves the rank
                    mlp.module = GroupedMoELayer
    return block


_LOGGED_EXPERTS: set[tuple[str, str]] = set()

# What megatron-core 0.16.1's TE spec puts in a MoE layer with moe_grouped_gemm off (as
# `moe_transformer_fields` sets it): TESpecProvider.grouped_mlp_modules' last branch.
TE_EXPERTS = "Transformer Engine's (megatron's SequentialMLP on TE linear layers)"


def _log_experts_once(name: str, reason: str) -> None:
    """The experts' choice and reason, logged once per process (not once per chunk)."""
    if (name, reason) not in _LOGGED_EXPERTS:
        _LOGGED_EXPERTS.add((name, reason))
        logger.info("MoE experts: %s (%s)", name, reason)


def experts_choice(
    device: torch.device, config: TransformerConfig, requested: str = "auto"
) -> ExpertsChoice:
    """`select_experts`, its choice and reason logged once per process."""
    choice = select_experts(device, config, requested)
    _log_experts_once(choice.name, choice.reason)
    return choice


def spec_experts(
    device: torch.device, config: TransformerConfig, requested: str, *, te: bool
) -> ExpertsChoice | None:
    """The experts module that replaces the block spec's own, or ``None`` to keep the spec's.

    Without TE: `experts_choice` (the local spec's SequentialMLP is only its default). With TE,
    ``megatron.experts: auto`` keeps TE's experts, and ``grouped`` / ``sequential`` put the
    module it names in TE's layer spec, the same module on the same local linear layers as
    without TE: a config key means the same on every machine, and both hold TE's parameter
    names (``local_experts.{i}.linear_fc1.weight``), so the Hugging Face conversion reads
    either. (The experts only exchange tensors with `MoELayer`'s dispatcher, which TE does not
    change here: permute fusion is off, `moe_transformer_fields`.)"""
    if not te:
        return experts_choice(device, config, requested)
    if requested == "auto":
        _log_experts_once(
            "transformer-engine",
            f"{TE_EXPERTS}: megatron.experts: auto with Transformer Engine installed; set "
            "megatron.experts: grouped or sequential to use unirl's choice instead",
        )
        return None
    choice = select_experts(device, config, requested)
    choice = attrs.evolve(
        choice, reason=f"{choice.reason}; in place of {TE_EXPERTS} in TE's layer spec"
    )
    _log_experts_once(choice.name, choice.reason)
    return choice


def check_experts_option(hf_config: Any, requested: str) -> None:
    """``megatron.experts`` picks a mixture-of-experts model's experts module: a dense model
    has none, and the key would change nothing (the plug-in's check refuses it too where it
    can read the model's config before the build, `plugin._check_experts`)."""
    if requested != "auto" and not is_moe(hf_config):
        raise ConfigError(
            f"megatron.experts={requested!r} chooses a mixture-of-experts model's experts "
            f"module; model_type={getattr(hf_config, 'model_type', None)!r} is dense (no "
            "experts): remove megatron.experts or set it to auto"
        )


def model_device() -> torch.device:
    """The device every chunk is built on: the current CUDA device when there is one."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --- building -------------------------------------------------------------------------------


def build_gpt_model(
    hf_config: Any,
    parallel: ParallelConfig,
    *,
    dtype: torch.dtype,
    pre_process: bool,
    post_process: bool,
    vp_stage: int | None = None,
    config_overrides: dict[str, Any] | None = None,
    use_te: bool | None = None,
    unfused_attention: bool = False,
    experts_module: str = "auto",
) -> GPTModel:
    """One model chunk (the layers of this pipeline stage / virtual stage), weights uninitialised,
    every parameter in ``dtype`` on the current CUDA device when there is one (else the CPU).

    Needs megatron's parallel state initialised with the same ``parallel`` sizes.
    """
    check_experts_option(hf_config, experts_module)
    overrides = dict(config_overrides or {})
    if model_device().type == "cuda":
        _install_gpu_fusions(hf_config, parallel, dtype, overrides)
    config = transformer_config(hf_config, parallel, dtype=dtype, **overrides)
    rope = rope_settings(hf_config)
    spec = _block_spec(
        hf_config,
        config,
        vp_stage=vp_stage,
        use_te=use_te,
        unfused_attention=unfused_attention,
        experts_module=experts_module,
    )
    model = UnirlGPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(hf_config.vocab_size, parallel.tp, VOCAB_DIVISIBLE_BY),
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
        position_embedding_type="rope",
        rotary_percent=1.0,
        vp_stage=vp_stage,
        **rope,
    )
    # torch norms are created in fp32 on the CPU whatever params_dtype / use_cpu_initialization
    # say: one dtype and one device for every parameter (as Float16Module / get_model would do)
    model = model.to(device=model_device(), dtype=dtype)
    gpu_fusions.convert(model)  # the Triton RMSNorm, where the fusions are on
    return model


def _install_gpu_fusions(
    hf_config: Any, parallel: ParallelConfig, dtype: torch.dtype, overrides: dict[str, Any]
) -> None:
    """On CUDA: unirl's kernels for this model's shapes, probed once; sets the weight-gradient
    fusion in ``overrides`` unless the caller chose it."""
    if "gradient_accumulation_fusion" not in overrides:
        # weight gradients added straight into DDP's fp32 main_grad (wgrad_fusion's docstring);
        # a frozen model's weights need no gradient, so the flag changes nothing there
        overrides["gradient_accumulation_fusion"] = wgrad_fusion.install()
    multi_tensor.install()  # the gradient norm without a host sync per gradient
    # Triton packed RoPE, SwiGLU backward and RMSNorm, the bias in the matmul epilogue (off
    # with TE, or where the install probe fails)
    dims = attention_dims(hf_config)
    tp = max(1, parallel.tp)
    heads = {dims["num_heads"] // tp, max(1, dims["num_query_groups"] // tp)}
    # the RoPE kernel takes bf16 / fp32 (an fp16 model's calls go to megatron's function)
    probed = dtype if dtype in (torch.bfloat16, torch.float32) else torch.bfloat16
    norms = {hf_config.hidden_size} | (
        {dims["head_dim"]} if hf_config.model_type in QK_NORM_MODEL_TYPES else set()
    )
    gpu_fusions.install(
        gpu_fusions.ProbeShape(dims["head_dim"], tuple(sorted(heads)), probed, tuple(sorted(norms)))
    )


def _block_spec(
    hf_config: Any,
    config: TransformerConfig,
    *,
    vp_stage: int | None,
    use_te: bool | None,
    unfused_attention: bool,
    experts_module: str,
) -> ModuleSpec | TransformerBlockSubmodules:
    """The transformer block's spec: megatron's MoE block or the dense layer spec, with torch
    norms marked for sequence parallel where TE's are not used."""
    if is_moe(hf_config):
        te_compat.install()  # the router's gating reads a name only TE binds
        spec: ModuleSpec | TransformerBlockSubmodules = moe_block_spec(
            config,
            vp_stage=vp_stage,
            device=model_device(),
            use_te=use_te,
            unfused_attention=unfused_attention,
            experts_module=experts_module,
        )
        # megatron's MoE block spec has torch norms wherever TE is not used
        if config.sequence_parallel and not (use_te if use_te is not None else te_available()):
            spec = sequence_parallel_norms(spec)
        return spec
    spec = layer_spec(
        use_te=use_te, unfused_attention=unfused_attention, qk_layernorm=config.qk_layernorm
    )
    te = not unfused_attention and (use_te if use_te is not None else te_available())
    if config.sequence_parallel and not te:  # the local spec's torch norms, marked for it
        spec = sequence_parallel_block(spec, config, vp_stage)
    return spec


def build_model_chunks(
    hf_config: Any,
    parallel: ParallelConfig,
    *,
    dtype: torch.dtype,
    config_overrides: dict[str, Any] | None = None,
    use_te: bool | None = None,
    unfused_attention: bool = False,
    experts_module: str = "auto",
) -> list[GPTModel]:
    """This rank's model chunks, one per virtual pipeline stage (one without VPP), in vp order.

    Which layers a chunk holds is megatron's choice (``get_transformer_layer_offset``): with
    pp=2, vpp=2 and 8 layers, stage 0 holds layers [0, 1] and [4, 5], stage 1 [2, 3] and [6, 7].
    Each layer's ``layer_number`` (1-based, global) says it; the conversion reads it from there.
    """
    if (parallel.tp, parallel.pp, parallel.cp, parallel.ep, parallel.etp or parallel.tp) != (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_context_parallel_world_size(),
        ps.get_expert_model_parallel_world_size(),
        ps.get_expert_tensor_parallel_world_size(),
    ):
        raise ConfigError(
            f"parallel (tp={parallel.tp}, pp={parallel.pp}, cp={parallel.cp}, ep={parallel.ep}, "
            f"etp={parallel.etp}) differs from the "
            "initialised megatron parallel state; call initialize_parallel_state(parallel) first"
        )
    chunks = []
    for vp in range(parallel.vpp or 1):
        vp_stage = vp if parallel.vpp is not None else None
        chunks.append(
            build_gpt_model(
                hf_config,
                parallel,
                dtype=dtype,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                vp_stage=vp_stage,
                config_overrides=config_overrides,
                use_te=use_te,
                unfused_attention=unfused_attention,
                experts_module=experts_module,
            )
        )
    return chunks


def chunk_layer_numbers(chunk: GPTModel) -> list[int]:
    """The 0-based global (HF) indices of the decoder layers a chunk holds."""
    return [layer.layer_number - 1 for layer in chunk.decoder.layers]
