"""Ulysses sequence parallel: attention over whole sequences while every other layer sees only
this rank's tokens.

The ``sp`` ranks of a group hold the same microbatch split with core's context-parallel layout
(`unirl.core.data.context_parallel`: every sequence padded to a multiple of ``2*sp``, rank ``r``
holding chunks ``r`` and ``2*sp-1-r``; every rank the same number of tokens). Embeddings, MLPs,
norms and the LM head are per-token, so they run on the local tokens. Attention is not: before it
an all-to-all turns ``[H, T_local, D]`` (all heads, my tokens) into ``[H/sp, T_padded, D]`` (my
heads, every token), the tokens are put back in sequence order, the packed varlen attention of
the HF backends (`unirl.backends.hf.packed`) runs over the padded global ``cu_seqlens``, and the inverse permutation and
all-to-all bring ``[T_local, H, D]`` back. Padding sits at the end of each sequence, so under the
causal mask no real token attends to it. (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv:2309.14509.)

Each all-to-all is an autograd function whose backward is the other one, so gradients take the
same route back. Grouped-query attention needs the key/value heads to divide by ``sp``; when they
do not, they are repeated up to the query heads first (more traffic, same result).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.distributed as dist

from unirl.backends.hf.packed import packed_attention, register_attention
from unirl.core.data.context_parallel import cp_local_indices
from unirl.core.errors import ConfigError

ATTN_NAME = "unirl_ulysses_varlen"
PLAN_KWARG = "unirl_ulysses"


@attrs.frozen(kw_only=True, eq=False)
class UlyssesPlan:
    """One microbatch's exchange: the SP group, the padded global ``cu_seqlens`` and the
    permutation between rank-major order (what the all-to-all yields) and sequence order."""

    group: Any
    sp: int
    cu_seqlens: torch.Tensor  # [S+1] int32, padded global stream
    max_len: int
    to_sequence: (
        torch.Tensor
    )  # [T_padded]: sequence-order position j comes from rank-major to_sequence[j]
    to_ranks: (
        torch.Tensor
    )  # [T_padded]: rank-major position i comes from sequence-order to_ranks[i]

    @classmethod
    def build(cls, local_cu: torch.Tensor, group: Any, device: torch.device) -> UlyssesPlan:
        sp = dist.get_world_size(group)
        padded_cu = local_cu.long() * sp  # every rank holds padded_length / sp of each sequence
        order = torch.cat([cp_local_indices(padded_cu, sp, r) for r in range(sp)])
        lengths = padded_cu[1:] - padded_cu[:-1]
        return cls(
            group=group,
            sp=sp,
            cu_seqlens=padded_cu.to(device, torch.int32),
            max_len=int(lengths.max()),
            to_sequence=torch.argsort(order).to(device),
            to_ranks=order.to(device),
        )


def _exchange(x: torch.Tensor, group: Any, sp: int) -> torch.Tensor:
    """``[sp, ...]`` block ``r`` goes to rank ``r``; block ``r`` of the result came from rank ``r``."""
    x = x.contiguous()  # the collective reads and writes flat memory
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _heads_to_tokens(x: torch.Tensor, group: Any, sp: int) -> torch.Tensor:
    """``[H, T_local, D]`` -> ``[H/sp, sp*T_local, D]`` (tokens rank-major)."""
    h, t, d = x.shape
    blocks = _exchange(x.reshape(sp, h // sp, t, d), group, sp)  # [sp(src rank), H/sp, T, D]
    return blocks.transpose(0, 1).reshape(h // sp, sp * t, d)


def _tokens_to_heads(x: torch.Tensor, group: Any, sp: int) -> torch.Tensor:
    """The inverse of `_heads_to_tokens`."""
    hs, st, d = x.shape
    t = st // sp
    blocks = x.reshape(hs, sp, t, d).transpose(0, 1)  # [sp(dst rank), H/sp, T, D]
    return _exchange(blocks, group, sp).reshape(sp * hs, t, d)


class _Exchange(torch.autograd.Function):
    """`_heads_to_tokens` (``to_tokens``) or `_tokens_to_heads`; the backward is the other."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, sp: int, to_tokens: bool) -> torch.Tensor:
        ctx.group, ctx.sp, ctx.to_tokens = group, sp, to_tokens
        return (_heads_to_tokens if to_tokens else _tokens_to_heads)(x, group, sp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        back = _tokens_to_heads if ctx.to_tokens else _heads_to_tokens
        return back(grad, ctx.group, ctx.sp), None, None, None


def ulysses_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function: ``query [1, H, T_local, D]`` -> ``[1, T_local, H, D]``.
    Without a plan (an empty microbatch runs one pad token on every SP rank alike) it is the
    plain packed attention."""
    plan: UlyssesPlan | None = kwargs.pop(PLAN_KWARG, None)
    if plan is None:
        return packed_attention(
            module, query, key, value, attention_mask, scaling, dropout, **kwargs
        )
    sp, group = plan.sp, plan.group
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % sp:
        raise ConfigError(
            f"fsdp2.sp={sp} does not divide the model's {heads} attention heads; Ulysses splits "
            "heads over the SP ranks: choose an sp that divides num_attention_heads"
        )
    if kv_heads % sp:  # repeat key/value heads up to the query heads (GQA groups stay aligned)
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)

    def gather(x: torch.Tensor) -> torch.Tensor:
        full = _Exchange.apply(x[0], group, sp, True)  # [H/sp, T_padded, D], rank-major
        return full.index_select(1, plan.to_sequence)[None]

    kwargs.update(
        cu_seq_lens_q=plan.cu_seqlens,
        cu_seq_lens_k=plan.cu_seqlens,
        max_length_q=plan.max_len,
        max_length_k=plan.max_len,
    )
    out, _ = packed_attention(
        module, gather(query), gather(key), gather(value), None, scaling, dropout, **kwargs
    )  # [1, T_padded, H/sp, D]
    out = out[0].transpose(0, 1).index_select(1, plan.to_ranks)  # [H/sp, T_padded, D]
    local = _Exchange.apply(out.contiguous(), group, sp, False)  # [H, T_local, D]
    return local.transpose(0, 1)[None], None


def use_ulysses_attention(model: Any) -> None:
    """Switch `model` to the Ulysses attention."""
    register_attention(model, ATTN_NAME, ulysses_attention, needed_for="fsdp2.sp > 1")
