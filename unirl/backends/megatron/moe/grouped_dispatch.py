"""The all-to-all token dispatcher of an MoE layer whose experts are `GroupedExperts` and that
exchanges no tokens (expert parallel and expert tensor parallel both 1): no host sync, no
identity sort, no atomics.

What megatron-core 0.16.1's `MoEAlltoAllTokenDispatcher` does there without TE's permute fusion,
and what each costs (one H200 profile of the Qwen3-30B-A3B layer shape, 8 layers, 9 microbatches):

- ``permute`` (moe_utils.py:369, :372) picks the routed rows with two ``masked_select`` calls:
  each reads the output size back to the host (``nonzero``), a host sync per layer and
  microbatch that waits for the router's kernels (392 ms of the step's 509 ms of syncs).
- ``_maybe_dtoh_and_synchronize`` (token_dispatcher.py:862) copies the tokens per expert to the
  host and waits for them before "permutation 2" (token_dispatcher.py:584), which then sorts
  the rows by local expert with ``sort_chunks_by_idxs`` (token_dispatcher.py:732, :767): a split
  into one chunk per expert and a ``cat``, in the order ``sort_input_by_local_experts``, which is
  the identity when ep x tp = 1 (token_dispatcher.py:405-416). `GroupedExperts` takes the tokens
  per expert on the device.
- the permute's backward (``index_select``'s: ``index_add_``, 160 ms) and the un-permute
  (``scatter_add_``, moe_utils.py:464, 72 ms) add the ``k`` rows of each token with atomics.

`LocalAlltoAllDispatcher` keeps megatron's preprocessing (the token counts, computed on the
device) and replaces those steps: when every row of the routing map holds exactly ``top_k``
experts (dropless routing, megatron's ``num_out_tokens = tokens * top_k``,
token_dispatcher.py:524) the routed rows come from one stable sort of the routing map (no
output size to read back), in ``masked_select``'s order (expert-major, tokens ascending), and
the permute / un-permute are gathers both ways (`_Permute`, `_Unpermute`): the ``k`` rows of a
token summed in one reduction (in fp32 inside the kernel, rounded once) instead of ``k``
atomic adds in the activation dtype. A replayed routing (`RecordingTopKRouter` with
``replay_experts``) may give a token fewer than ``k`` experts: that forward takes megatron's
``permute`` / ``unpermute`` (with their syncs); the identity sort and the host copy stay off.

`GroupedMoELayer` (the MoE layer of `model.moe_block_spec` when the experts are grouped) builds
this dispatcher where it applies and megatron's otherwise.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from megatron.core import package_info
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from unirl.backends.megatron.moe.grouped_experts import GroupedExperts
from unirl.backends.megatron.moe.layers import RecordingTopKRouter

logger = logging.getLogger(__name__)

# The megatron-core versions whose token_dispatcher.py / moe_utils.py lines above were read.
CHECKED_VERSIONS = ("0.16.1",)


def local_dispatch_reason(layer: MoELayer) -> str | None:
    """Why ``layer`` keeps megatron's dispatcher, or ``None`` when `LocalAlltoAllDispatcher`
    computes its dispatch (see the module docstring)."""
    cfg = layer.config
    dispatcher = layer.token_dispatcher
    if package_info.__version__ not in CHECKED_VERSIONS:
        return (
            f"megatron-core {package_info.__version__}: unirl/backends/megatron/"
            f"grouped_dispatch.py was read against {', '.join(CHECKED_VERSIONS)}"
        )
    if not isinstance(layer.experts, GroupedExperts):
        return "the experts are not GroupedExperts (they take the tokens per expert on the host)"
    if cfg.moe_token_dispatcher_type != "alltoall":
        return f"moe_token_dispatcher_type={cfg.moe_token_dispatcher_type}"
    if dispatcher.ep_size * dispatcher.tp_size != 1:
        return "tokens cross ranks (expert parallel or expert tensor parallel > 1)"
    if cfg.moe_expert_capacity_factor is not None or cfg.moe_router_padding_for_quantization:
        return "token dropping / router padding (the routed row count is not tokens x top_k)"
    if cfg.moe_permute_fusion or cfg.cuda_graph_impl != "none":
        return "TE's permute fusion or CUDA graphs own the dispatch"
    if layer.use_shared_expert:
        return "shared experts (Qwen3-MoE has none; their overlap hooks are megatron's)"
    return None


class _Permute(torch.autograd.Function):
    """``rows = tokens[token_p]``; backward: each token's gradient is the sum of its ``k`` rows'
    (``rows_tk`` the positions of token ``t``'s rows), a gather, not ``index_add_``."""

    @staticmethod
    def forward(ctx: Any, tokens_th: torch.Tensor, token_p: torch.Tensor, rows_tk: torch.Tensor):
        ctx.save_for_backward(rows_tk)
        return tokens_th.index_select(0, token_p)

    @staticmethod
    def backward(ctx: Any, grad_ph: torch.Tensor):
        (rows_tk,) = ctx.saved_tensors
        t, k = rows_tk.shape
        grad_th = grad_ph.index_select(0, rows_tk.reshape(-1)).view(t, k, -1).sum(dim=1)
        return grad_th, None, None


class _Unpermute(torch.autograd.Function):
    """``out[t] = sum_j rows[rows_tk[t, j]]``; backward: ``grad_rows = grad_out[token_p]``."""

    @staticmethod
    def forward(ctx: Any, rows_ph: torch.Tensor, token_p: torch.Tensor, rows_tk: torch.Tensor):
        ctx.save_for_backward(token_p)
        t, k = rows_tk.shape
        return rows_ph.index_select(0, rows_tk.reshape(-1)).view(t, k, -1).sum(dim=1)

    @staticmethod
    def backward(ctx: Any, grad_th: torch.Tensor):
        (token_p,) = ctx.saved_tensors
        return grad_th.index_select(0, token_p), None, None


def topk_permutation(
    routing_map_te: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For a routing map with exactly ``top_k`` experts per row: ``(flat_p, token_p,
    rows_tk)``: the routed (expert, token) pairs in megatron's permuted order (expert-major,
    tokens ascending) as flat indices ``e * T + t`` of the transposed map, their tokens, and
    for each token the positions of its ``k`` rows (experts ascending). Sizes from shapes
    only: no host sync."""
    num_tokens, num_experts = routing_map_te.shape
    flat = routing_map_te.t().contiguous().view(-1).to(torch.int8)
    # stable: the True entries first, in their index order (masked_select's order)
    flat_p = torch.argsort(flat, descending=True, stable=True)[: num_tokens * top_k]
    token_p = flat_p % num_tokens
    expert_p = flat_p // num_tokens
    # positions sorted by (token, expert): k consecutive per token
    rows_tk = torch.argsort(token_p * num_experts + expert_p).view(num_tokens, top_k)
    return flat_p, token_p, rows_tk


class LocalAlltoAllDispatcher(MoEAlltoAllTokenDispatcher):
    """megatron's all-to-all dispatcher for ep x tp = 1 with `GroupedExperts` (see the module
    docstring); ``router`` is the layer's router (is this forward's routing replayed?)."""

    router: torch.nn.Module

    def _exact_topk(self) -> bool:
        """Every row of this forward's routing map holds ``top_k`` experts (a replayed routing
        may give a token an expert twice, counted once)."""
        return not (
            isinstance(self.router, RecordingTopKRouter) and self.router.replay_experts is not None
        )

    def dispatch_preprocess(
        self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.permutation = None
        if not self._exact_topk():
            return super().dispatch_preprocess(hidden_states, routing_map, probs)
        # megatron's dispatch_preprocess without router padding (refused) and with the permute
        # below in place of moe_utils.permute
        self.hidden_shape = hidden_states.shape
        self.probs = probs
        self.routing_map = routing_map
        assert probs.dim() == 2 and routing_map.dim() == 2 and routing_map.dtype == torch.bool
        hidden_th = hidden_states.view(-1, self.hidden_shape[-1])
        self.tokens_per_expert = self.preprocess(routing_map)
        self.hidden_shape_before_permute = hidden_th.shape
        flat_p, token_p, rows_tk = topk_permutation(routing_map, self.config.moe_router_topk)
        self.permutation = (token_p, rows_tk)
        self.reversed_local_input_permutation_mapping = token_p
        permuted_probs = probs.t().contiguous().view(-1).index_select(0, flat_p)
        return _Permute.apply(hidden_th, token_p, rows_tk), permuted_probs

    def _maybe_dtoh_and_synchronize(
        self, point: str, tokens_per_expert: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        # GroupedExperts reads the tokens per expert on the device; nothing else needs the host
        # copy when no token leaves the rank (no all-to-all split sizes)
        return tokens_per_expert

    def dispatch_postprocess(
        self, global_input_tokens: torch.Tensor, global_probs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # ep x tp = 1: no all-gather, and sorting by local expert is the identity
        tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
        return global_input_tokens, tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states  # the identity un-sort, no reduce-scatter (see dispatch_postprocess)

    def combine_postprocess(self, permutated_local_input_tokens: torch.Tensor) -> torch.Tensor:
        if self.permutation is None:
            return super().combine_postprocess(permutated_local_input_tokens)
        token_p, rows_tk = self.permutation
        self.permutation = None
        output = _Unpermute.apply(permutated_local_input_tokens, token_p, rows_tk)
        return output.view(self.hidden_shape)


class GroupedMoELayer(MoELayer):
    """megatron's `MoELayer` whose all-to-all dispatcher is `LocalAlltoAllDispatcher` where
    `local_dispatch_reason` allows (same parameters and state dict: the dispatcher has none)."""

    def __init__(
        self,
        config: Any,
        submodules: Any = None,
        layer_number: int | None = None,
        pg_collection: Any = None,
    ) -> None:
        if pg_collection is None:  # as MoELayer.__init__
            pg_collection = get_default_pg_collection()
        super().__init__(config, submodules, layer_number, pg_collection)
        reason = local_dispatch_reason(self)
        if reason is not None:
            logger.debug("MoE layer %s keeps megatron's dispatcher: %s", layer_number, reason)
            return
        assert type(self.token_dispatcher) is MoEAlltoAllTokenDispatcher, self.token_dispatcher
        self.token_dispatcher = LocalAlltoAllDispatcher(
            self.num_local_experts,
            self.local_expert_indices,
            config=self.config,
            pg_collection=pg_collection,
        )
        self.token_dispatcher.router = self.router
