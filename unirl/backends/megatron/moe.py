"""Qwen3-MoE's sparse layers as megatron-core MoE layers (local spec, no Transformer Engine).

Hugging Face's `Qwen3MoeSparseMoeBlock` routes each token as: logits = router(x); p =
softmax(logits) over all experts; the top-k of p; with ``norm_topk_prob`` the k weights divided by
their sum; the output is sum_k w_k * expert_k(x), each expert a SwiGLU MLP of width
``moe_intermediate_size``. megatron-core's `TopKRouter` with the softmax score function gives the
same weights:

- ``norm_topk_prob=True``: top-k of the logits, then softmax over those k
  (``moe_router_pre_softmax=False``): softmax is monotone, so the same experts, and
  softmax(top-k logits) = top-k(softmax) / its sum.
- ``norm_topk_prob=False``: softmax over all, then top-k (``moe_router_pre_softmax=True``).

Tokens reach the experts through the all-to-all dispatcher (``parallel.ep`` ranks each hold
``num_experts / ep`` experts, as `SequentialMLP`), with no capacity limit (dropless). Dense layers
of a Qwen3-MoE config (``mlp_only_layers``, ``decoder_sparse_step``) become megatron's dense
layers through ``moe_layer_freq``.

megatron-core's own load-balancing and z-losses are off: core computes the router losses from the
logits each router records (`collect_router_logits`, put in the microbatch's packed token order by
`microbatch_router_logits`), the same way on every backend (`unirl.core.moe_loss.router_term`,
``algorithm.router_aux_loss_coef`` / ``router_z_loss_coef``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from megatron.core.transformer.moe.router import TopKRouter

from unirl.backends.megatron.padded import PaddedBatch
from unirl.core.errors import ConfigError
from unirl.core.run.config import ParallelConfig

MOE_MODEL_TYPES = ("qwen3_moe",)


def is_moe(hf_config: Any) -> bool:
    return getattr(hf_config, "model_type", None) in MOE_MODEL_TYPES


def moe_layer_pattern(hf_config: Any) -> list[int]:
    """1 for each HF layer with a sparse MoE block, 0 for a dense MLP (HF's own rule)."""
    only_dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
    step = hf_config.decoder_sparse_step
    return [
        int(i not in only_dense and hf_config.num_experts > 0 and (i + 1) % step == 0)
        for i in range(hf_config.num_hidden_layers)
    ]


def check_moe_config(hf_config: Any, parallel: ParallelConfig) -> None:
    """Reject what the MoE layers or their weight conversion do not reproduce exactly."""
    experts, top_k = hf_config.num_experts, hf_config.num_experts_per_tok
    if experts < 1 or not 1 <= top_k <= experts:
        raise ConfigError(
            f"model.hf_config.num_experts={experts}, num_experts_per_tok={top_k}: need "
            "1 <= num_experts_per_tok <= num_experts"
        )
    if hf_config.decoder_sparse_step < 1:
        raise ConfigError(
            f"model.hf_config.decoder_sparse_step={hf_config.decoder_sparse_step} must be >= 1"
        )
    if not any(moe_layer_pattern(hf_config)):
        raise ConfigError(
            "model.hf_config (qwen3_moe) has no sparse layer (mlp_only_layers / "
            "decoder_sparse_step leave every layer dense); use model_type qwen3 for a dense model"
        )
    if top_k == 1 and hf_config.norm_topk_prob:
        # HF's weight is then 1; megatron-core refuses softmax over one logit (zero gradient)
        raise ConfigError(
            "model.hf_config.num_experts_per_tok=1 with norm_topk_prob=True is not supported by "
            "the Megatron backend (megatron-core routes top-1 only with softmax before top-k, "
            "weight p_top1, not 1); use backend: deepspeed or fsdp2 for this model"
        )
    if experts % parallel.ep:
        raise ConfigError(
            f"parallel.ep={parallel.ep} does not divide model.hf_config.num_experts={experts}: "
            "each expert-parallel rank holds num_experts / ep whole experts"
        )
    etp = parallel.etp or parallel.tp
    if hf_config.moe_intermediate_size % etp:
        raise ConfigError(
            f"parallel.etp={etp} does not divide model.hf_config.moe_intermediate_size="
            f"{hf_config.moe_intermediate_size}"
        )


def moe_transformer_fields(hf_config: Any, parallel: ParallelConfig) -> dict[str, Any]:
    """The `TransformerConfig` fields of Qwen3-MoE's sparse layers under ``parallel``."""
    return dict(
        num_moe_experts=hf_config.num_experts,
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        moe_layer_freq=moe_layer_pattern(hf_config),
        moe_router_score_function="softmax",
        # see the module docstring: both give HF's weights
        moe_router_pre_softmax=not hf_config.norm_topk_prob,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,  # SequentialMLP: the one expert module without TE or grouped_gemm
        # the router losses are core's (`collect_router_logits`), not megatron's
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_z_loss_coeff=None,
        moe_expert_capacity_factor=None,  # dropless: every token reaches its k experts
        moe_permute_fusion=False,
        moe_router_fusion=False,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.etp or parallel.tp,
    )


class RecordingTopKRouter(TopKRouter):
    """megatron's `TopKRouter`, also keeping the router logits ``[tokens, num_experts]`` of each
    forward (autograd-connected, in the order megatron flattens ``[S, B]``: sequence-major) until
    `collect_router_logits` takes them. Only forwards with autograd enabled record, so
    forward-only passes keep nothing; under full activation recompute the first forward runs
    without autograd and the logits are recorded by the recompute, in the backward."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.recorded_logits: list[torch.Tensor] = []

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        logits = super().gating(input)
        if torch.is_grad_enabled():
            self.recorded_logits.append(logits.reshape(-1, logits.shape[-1]))
        return logits


def microbatch_router_logits(chunks: Sequence[torch.nn.Module], batch: Any) -> list[torch.Tensor]:
    """`collect_router_logits` of one microbatch's forward in the packed token order core's
    `router_term` reads: a packed stream (``[S, 1]``) already is (the stream's padding comes after
    the microbatch's tokens, CP padding is dropped by core); right-padded rows (``[S, B]``,
    flattened sequence-major by megatron) are gathered to the microbatch's real tokens."""
    logits = collect_router_logits(chunks)
    if not isinstance(batch, PaddedBatch):
        return logits
    rows = batch.tokens.shape[0]
    return [
        lg.reshape(-1, rows, lg.shape[-1])
        .transpose(0, 1)
        .reshape(-1, lg.shape[-1])
        .index_select(0, batch.flat_index)
        for lg in logits
    ]


def collect_router_logits(chunks: Sequence[torch.nn.Module]) -> list[torch.Tensor]:
    """The router logits recorded since the last call, one ``[tokens, num_experts]`` tensor per
    MoE layer of this rank's chunks and per forward, in layer order (each router's list is
    emptied). For one microbatch's forward that is one tensor per local MoE layer: the input
    `unirl.core.maths.losses.router.router_losses` takes (after keeping the microbatch's real
    tokens). Under pipeline parallel each stage holds its own layers' logits: their loss term is
    backpropagated on that stage."""
    out = []
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, RecordingTopKRouter):
                out.extend(module.recorded_logits)
                module.recorded_logits = []
    return out
