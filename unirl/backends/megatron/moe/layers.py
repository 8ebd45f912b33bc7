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

from unirl.backends.megatron.compat.sequence_parallel import gather_hidden
from unirl.backends.megatron.padded import PaddedBatch
from unirl.core.config.run_config import ParallelConfig
from unirl.core.data.routed_experts import DTYPE, FREE
from unirl.core.errors import ConfigError, LossInputError
from unirl.core.maths.losses.router_disagreement import routing_disagreement

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
    without autograd and the logits are recorded by the recompute, in the backward.

    Routing replay (``algorithm.routing_replay``, our own, not megatron-core's `RouterReplay`,
    which router fusion silently skips and which keeps its objects in construction order): with
    ``replay_experts`` set (``[tokens, top_k]`` in the router's row order, `FREE` rows routed
    freely) the top-k becomes the given experts and their weights the router's softmax
    probabilities at them, renormalised when ``norm_topk_prob`` (Hugging Face's arithmetic, as
    `unirl.backends.hf.router_replay.replayed_routing`), so the router weight keeps its
    gradient; an expert given twice in a row gets both weights summed (HF's sum over k) and its
    token once, so the all-to-all token counts stay those of the routing map. Each replayed
    forward appends its disagreement counts (free top-k vs given) to ``replay_counts``; with
    ``record_indices`` the free top-k ``[tokens, top_k]`` of each forward goes to
    ``recorded_indices`` (R2)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.recorded_logits: list[torch.Tensor] = []
        self.replay_experts: torch.Tensor | None = None
        self.norm_topk_prob = not self.config.moe_router_pre_softmax  # see the module docstring
        self.replay_counts: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.record_indices = False
        self.recorded_indices: list[torch.Tensor] = []

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        logits = super().gating(input)
        if torch.is_grad_enabled():
            recorded = logits.reshape(-1, logits.shape[-1])
            if self.config.sequence_parallel:
                # this TP rank routes its slice of the sequence; the loss reads the whole
                # microbatch's rows on every TP rank (`sequence_parallel.gather_hidden`'s
                # gradient rule: each rank keeps its own slice's, the router weight's gradient
                # is then summed over TP by megatron: it is marked ``sequence_parallel``)
                recorded = gather_hidden(recorded)
            self.recorded_logits.append(recorded)
        return logits

    def routing(
        self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        probs, routing_map = super().routing(logits, padding_mask=padding_mask)
        if self.replay_experts is None and not self.record_indices:
            return probs, routing_map
        logits_ne = logits.reshape(-1, self.config.num_moe_experts)
        free_nk = torch.topk(probs.detach(), self.topk, dim=-1).indices
        if self.record_indices:
            self.recorded_indices.append(free_nk.to(DTYPE))
        if self.replay_experts is None:
            return probs, routing_map
        given = self.replay_experts.to(device=logits.device, dtype=torch.long)
        if given.shape != free_nk.shape:
            raise LossInputError(
                f"routing replay: MoE layer {self.layer_number} routes {tuple(free_nk.shape)} "
                f"(tokens, top_k) but routed_experts gives {tuple(given.shape)}"
            )
        self.replay_counts.append(routing_disagreement(free_nk, given))
        forced = given[:, :1] != FREE
        chosen = torch.where(forced, given, free_nk)
        weights = torch.softmax(logits_ne, dim=-1, dtype=torch.float).gather(1, chosen)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        replayed = torch.zeros_like(probs).scatter_add(1, chosen, weights.to(probs.dtype))
        replayed_map = torch.zeros_like(routing_map).scatter(1, chosen, True)
        return (
            torch.where(forced, replayed, probs),
            torch.where(forced, replayed_map, routing_map),
        )


def moe_layer_index(hf_config: Any, layer_number: int) -> int:
    """The MoE-layer column of ``routed_experts`` for megatron's (1-based, global) layer number."""
    return sum(moe_layer_pattern(hf_config)[: layer_number - 1])


def routers(chunks: Sequence[torch.nn.Module]) -> list[RecordingTopKRouter]:
    """This rank's MoE routers, in layer order."""
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, RecordingTopKRouter)]


def stream_experts(experts_tlk: torch.Tensor, batch: Any) -> torch.Tensor:
    """``mb.routed_experts`` ``[T, moe_layers, top_k]`` (the microbatch's tokens in packed
    order) in the routers' row order for ``batch``: a packed stream's own rows then `FREE` for
    its padding; right-padded rows scattered into ``[rows, L]`` (`FREE` padding), then
    sequence-major as megatron flattens ``[S, B]``."""
    _, layers, k = experts_tlk.shape
    if isinstance(batch, PaddedBatch):
        rows, length = batch.tokens.shape
        full = experts_tlk.new_full((rows * length, layers, k), FREE)
        full[batch.flat_index.to(full.device)] = experts_tlk
        return full.reshape(rows, length, layers, k).transpose(0, 1).reshape(-1, layers, k)
    total = batch.inputs.input_ids.shape[-1]
    full = experts_tlk.new_full((total, layers, k), FREE)
    full[: experts_tlk.shape[0]] = experts_tlk
    return full


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
