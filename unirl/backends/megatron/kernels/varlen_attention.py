"""Causal attention over packed (THD) sequences, with and without context parallel, without
Transformer Engine.

**Packed.** ``q [T, Hq, D]``, ``k``/``v [T, Hkv, D]`` hold ``S`` sequences back to back
(``cu_seqlens [S+1]``); token ``i`` of sequence ``s`` attends to tokens ``0..i`` of ``s`` only::

    out_i = softmax(q_i K_s[:i+1]^T * scale) V_s[:i+1]        scale = 1/sqrt(D) by default

GQA: query head ``h`` uses key/value head ``h // (Hq / Hkv)`` (Megatron's grouping). On CUDA in
bf16/fp16 this is one call of `torch.nn.attention.varlen.varlen_attn` (flash attention,
``window_size=(-1, 0)`` = causal); elsewhere a causal SDPA per sequence (the CPU reference path).

**Context parallel.** Each CP rank holds the two load-balanced chunks of every sequence
(`unirl.core.data.context_parallel`): chunk ``r`` and chunk ``2*cp-1-r``, whose *global* positions are
``CPLayout.position_ids``. Keys and values are all-gathered over the CP group and put back in the
padded global order; a local query at global position ``p`` of sequence ``s`` attends to the keys
of ``s`` at global positions ``<= p``. The all-gather is autograd-aware: its backward sums the
gradient of every rank's output over the group and keeps this rank's slice (a reduce-scatter),
so the gradients of the CP ranks' local k/v are those of CP=1. Padding sits at the end of each
sequence, so no real query sees it. With flash attention each local chunk is its own query
segment whose keys are the sequence's prefix up to the chunk's end: flash's causal mask is
bottom-right aligned for ``len_q < len_k``, which is exactly "global position ``<= p``".

All-gather instead of ring attention: simple and exact; memory is ``O(T_padded)`` keys/values per
rank per layer, fine for RL sequence lengths; ring attention would overlap the exchange.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import math
from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.nn.functional as F

from unirl.backends.cudnn_attention import cudnn_packed, use_cudnn
from unirl.backends.cudnn_attention import probe_ahead as cudnn_probe_ahead
from unirl.core.data.context_parallel import CPLayout, cp_local_indices
from unirl.core.errors import LossInputError

logger = logging.getLogger(__name__)

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # pragma: no cover - older torch
    _varlen_attn = None

CAUSAL_WINDOW = (-1, 0)  # varlen_attn's causal mask (no left limit, nothing to the right)
# Keyword arguments this torch's varlen_attn takes (torch 2.11 has no `enable_gqa`; 2.13 has).
_VARLEN_PARAMS = (
    frozenset(inspect.signature(_varlen_attn).parameters)
    if _varlen_attn is not None
    else frozenset()
)


def varlen_available(q: torch.Tensor) -> bool:
    """Whether the flash (varlen) path runs for ``q``: CUDA, bf16/fp16, torch has varlen_attn."""
    return (
        _varlen_attn is not None
        and "window_size" in _VARLEN_PARAMS  # torch 2.10's varlen_attn has no causal window
        and q.is_cuda
        and q.dtype in (torch.bfloat16, torch.float16)
    )


# Whether this torch's varlen_attn (no ``enable_gqa``) takes fewer key/value heads than query
# heads as they are, by kernel function and device type: `_takes_gqa` checks it once.
_NATIVE_GQA: dict[tuple[Any, str, torch.dtype], bool] = {}


def _takes_gqa(q: torch.Tensor) -> bool:
    """torch 2.11's varlen_attn has no ``enable_gqa`` argument but hands k / v unchanged to the
    flash kernel, which serves query head ``h`` from key/value head ``h // (Hq / Hkv)`` itself
    (Megatron's grouping) and sums their gradients back: no repeated k / v (two ``[T, Hq, D]``
    copies per layer in the forward, kept for the backward, and their reduction after it).
    Checked once per process against the repeated heads, forward and backward; an error or a
    difference keeps the repeat."""
    key = (_varlen_attn, q.device.type, q.dtype)
    if key not in _NATIVE_GQA:
        why = _native_gqa_probe(q.device, q.dtype)
        if why is not None:
            logger.info("packed attention repeats the key/value heads (%s): %s", q.dtype, why)
        _NATIVE_GQA[key] = why is None
    return _NATIVE_GQA[key]


def probe_ahead(x: torch.Tensor, head_dim: int) -> None:
    """Run this path's one-time kernel probes now for tensors like ``x`` (device and dtype):
    cuDNN's (`unirl.backends.cudnn_attention.probe_ahead`) and, on a torch whose varlen_attn
    has no ``enable_gqa``, `_takes_gqa`'s. For a training forward under a selective checkpoint
    (`unirl.backends.kept_attention`), which must not see a probe's kernels."""
    cudnn_probe_ahead(x.device, x.dtype, head_dim)
    q = x.new_empty(1, 1, head_dim)
    if varlen_available(q) and "enable_gqa" not in _VARLEN_PARAMS:
        _takes_gqa(q)


def _native_gqa_probe(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when `_varlen_attn` with 2 key/value heads for 4 query heads gives the output and
    gradients of the same call with the key/value heads repeated, else why not."""
    kwargs: dict[str, Any] = {"window_size": CAUSAL_WINDOW}
    if "scale" in _VARLEN_PARAMS:
        kwargs["scale"] = 0.25
    results = []
    try:
        # the first packed call may come from a forward-only pass: autograd on here
        with torch.inference_mode(False), torch.enable_grad():
            gen = torch.Generator().manual_seed(0)
            cu = torch.tensor([0, 5, 24], dtype=torch.int32, device=device)
            q, k, v, grad = (
                torch.randn(24, h, 16, generator=gen).to(device, dtype) for h in (4, 2, 2, 4)
            )
            for repeat in (1, 2):
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                kv = [t.repeat_interleave(repeat, dim=1) for t in leaves[1:]]
                out = _varlen_attn(leaves[0], *kv, cu, cu, 19, 19, **kwargs)
                results.append((out, *torch.autograd.grad(out, leaves, grad)))
    except Exception as exc:  # a torch whose kernel refuses (or mis-shapes) grouped heads
        return f"{type(exc).__name__}: {exc}"
    for native, repeated in zip(*results):
        if native.shape != repeated.shape or not torch.allclose(
            native.float(),
            repeated.float(),
            rtol=2e-2,
            atol=2e-2,  # bf16: a few ulp
        ):
            return "grouped heads differ from repeated heads"
    return None


def _varlen_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
) -> torch.Tensor:
    """Causal (bottom-right aligned) flash attention over packed segments."""
    kwargs: dict[str, Any] = {"window_size": CAUSAL_WINDOW}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in _VARLEN_PARAMS:
            kwargs["enable_gqa"] = True
        elif not _takes_gqa(q):  # one key/value head per query head, Megatron's grouping
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        else:  # contiguous as in the probe (v arrives as a strided view of the fused qkv)
            k, v = k.contiguous(), v.contiguous()
    if "scale" in _VARLEN_PARAMS:
        kwargs["scale"] = scale
    elif abs(scale * math.sqrt(q.shape[-1]) - 1.0) > 1e-12:
        q = q * (scale * math.sqrt(q.shape[-1]))  # the kernel's own scale is 1/sqrt(D)
    return _varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


def _flash_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One whole sequence on the flash kernel (cuDNN's fallback)."""
    n = q.shape[0]
    cu = torch.tensor([0, n], dtype=torch.int32, device=q.device)
    return _varlen_kernel(q, k, v, cu, cu, n, n, scale)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tokens: int) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise LossInputError(
            f"q must be [T, Hq, D] and k, v [T, Hkv, D]; got q {tuple(q.shape)}, k "
            f"{tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[0] != tokens or k.shape[0] != tokens:
        raise LossInputError(
            f"q and k must have {tokens} tokens (cu_seqlens[-1] / the layout's local token "
            f"count); got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise LossInputError(
            f"q heads ({q.shape[1]}) must be a multiple of k heads ({k.shape[1]}) and head dims "
            f"must match; got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )


def _repeat_kv(t: torch.Tensor, q_heads: int) -> torch.Tensor:
    """[N, Hkv, D] -> [N, Hq, D]: each kv head serves ``Hq / Hkv`` consecutive query heads."""
    return t if t.shape[1] == q_heads else t.repeat_interleave(q_heads // t.shape[1], dim=1)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, **kw: Any
) -> torch.Tensor:
    """SDPA on [N, H, D] tensors, as one batch of 4-D ``[1, H, N, D]`` (a 3-D input takes SDPA's
    math path everywhere: no fused kernel, whose outputs `unirl.backends.kept_attention` keeps)."""
    k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=scale, **kw
    )
    return out[0].transpose(0, 1)


# --- packed, no CP ---------------------------------------------------------------------------


def packed_position_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Position of every token within its own sequence (``[T]`` long): RoPE restarts per
    sequence in a packed stream."""
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lengths)
    return torch.arange(int(cu[-1]), device=cu.device) - starts


def max_seqlen(cu_seqlens: torch.Tensor) -> int:
    """The longest sequence of ``cu_seqlens`` (0 when there is none); one host sync."""
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0


def packed_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None = None,
    longest_seq: int | None = None,
    total_tokens: int | None = None,
) -> torch.Tensor:
    """Causal attention within each packed sequence; ``[T, Hq, D]`` out.

    ``longest_seq`` (the longest sequence) and ``total_tokens`` (``cu_seqlens[-1]``) save the
    flash path a host sync per call each; Megatron's `PackedSeqParams` carries both.
    """
    _check_qkv(q, k, v, int(cu_seqlens[-1]) if total_tokens is None else total_tokens)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if varlen_available(q):
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        longest = max_seqlen(cu) if longest_seq is None else longest_seq
        if use_cudnn(q, longest):  # long sequences: cuDNN's kernel (unirl.backends.cudnn_attention)
            whole = longest == q.shape[0]  # one sequence fills the pack: no host sync
            bounds = [0, longest] if whole else cu.tolist()
            return cudnn_packed(q, k, v, bounds, scale, functools.partial(_flash_one, scale=scale))
        return _varlen_kernel(q, k, v, cu, cu, longest, longest, scale)
    bounds = cu_seqlens.tolist()
    pieces = [
        _sdpa(q[a:b], k[a:b], v[a:b], scale, is_causal=True)
        for a, b in itertools.pairwise(bounds)
        if b > a
    ]
    return torch.cat(pieces) if pieces else q.new_empty(q.shape)


# --- context parallel ------------------------------------------------------------------------


class _AllGatherCP(torch.autograd.Function):
    """``[N, ...]`` per rank -> ``[cp * N, ...]`` (rank-major) on every rank.

    Backward: the output is replicated and the objective is the sum of every rank's loss, so
    rank r's input gets slice r of the gradient summed over ranks (a reduce-scatter; written as
    all-reduce + slice so it runs on gloo too).
    """

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        ctx.rank = dist.get_rank(group)
        ctx.n = local.shape[0]
        local = local.contiguous()
        pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, local, group=group)
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n], None


@attrs.frozen(kw_only=True, eq=False)
class CPAttentionIndex:
    """Index tensors of one microbatch's CP attention, built once and reused by every layer.

    ``gather_order[p]``: row of the rank-major all-gathered stream that holds padded global
    position ``p``. The varlen fields describe two query segments per sequence (the two local
    chunks) and, for each, the key prefix it sees (``key_index`` into the padded global stream).
    """

    gather_order: torch.Tensor  # [T_padded] long
    query_bounds: tuple[int, ...]  # local cu_seqlens, host ints (SDPA path)
    key_bounds: tuple[int, ...]  # global padded cu_seqlens, host ints (SDPA path)
    position_ids: torch.Tensor  # [T_local] global position of each local query
    cu_q: torch.Tensor  # [2S+1] int32: the local chunks as query segments
    cu_k: torch.Tensor  # [2S+1] int32: their key prefixes, concatenated
    key_index: torch.Tensor  # [cu_k[-1]] long, into the padded global stream
    max_q: int
    max_k: int

    @classmethod
    def build(cls, layout: CPLayout, device: torch.device | str = "cpu") -> CPAttentionIndex:
        cp, r = layout.cp_size, layout.cp_rank
        padded = layout.cu_seqlens_padded.long().cpu()
        order = torch.cat([cp_local_indices(padded, cp, rank) for rank in range(cp)])
        starts = padded[:-1].tolist()
        chunks = ((padded[1:] - padded[:-1]) // (2 * cp)).tolist()
        q_lens, k_lens, key_index = [], [], []
        for start, c in zip(starts, chunks):
            # chunk r ends at global position (r+1)*c, chunk 2cp-1-r at (2cp-r)*c
            for end in ((r + 1) * c, (2 * cp - r) * c):
                q_lens.append(c)
                k_lens.append(end)
                key_index.append(torch.arange(start, start + end))

        def cum(lengths: list[int]) -> torch.Tensor:
            return torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()])

        return cls(
            gather_order=torch.argsort(order).to(device),
            query_bounds=tuple(layout.local_cu_seqlens.tolist()),
            key_bounds=tuple(padded.tolist()),
            position_ids=layout.position_ids.to(device),
            cu_q=cum(q_lens).to(device=device, dtype=torch.int32),
            cu_k=cum(k_lens).to(device=device, dtype=torch.int32),
            key_index=(torch.cat(key_index) if key_index else torch.zeros(0, dtype=torch.long))
            .long()
            .to(device),
            max_q=max(q_lens, default=0),
            max_k=max(k_lens, default=0),
        )


def cp_packed_causal_attention(
    q_local: torch.Tensor,
    k_local: torch.Tensor,
    v_local: torch.Tensor,
    layout: CPLayout,
    cp_group: Any,
    *,
    scale: float | None = None,
    index: CPAttentionIndex | None = None,
) -> torch.Tensor:
    """Causal packed attention of this CP rank's local queries against the whole sequences.

    ``q_local [T_local, Hq, D]`` etc. are in `CPLayout` local order (RoPE already applied with
    the global positions). Every rank of ``cp_group`` must call it, and run backward through it
    if any rank does. ``index``: `CPAttentionIndex.build(layout, device)`, built once per
    microbatch and shared by the layers (built here when not given). ``cp_size == 1``: plain
    `packed_causal_attention`.
    """
    if layout.cp_size == 1:
        return packed_causal_attention(
            q_local, k_local, v_local, layout.local_cu_seqlens, scale=scale
        )
    if cp_group is None or dist.get_world_size(cp_group) != layout.cp_size:
        got = None if cp_group is None else dist.get_world_size(cp_group)
        raise LossInputError(
            f"cp_group has {got} ranks but the layout has cp_size={layout.cp_size}; pass the "
            "context-parallel group the layout was built for"
        )
    _check_qkv(q_local, k_local, v_local, int(layout.local_cu_seqlens[-1]))
    scale = 1.0 / math.sqrt(q_local.shape[-1]) if scale is None else scale
    index = index if index is not None else CPAttentionIndex.build(layout, q_local.device)
    # keys / values of the whole padded stream, in global order
    k = _AllGatherCP.apply(k_local, cp_group).index_select(0, index.gather_order)
    v = _AllGatherCP.apply(v_local, cp_group).index_select(0, index.gather_order)
    if varlen_available(q_local):
        return _varlen_kernel(
            q_local,
            k.index_select(0, index.key_index),
            v.index_select(0, index.key_index),
            index.cu_q,
            index.cu_k,
            index.max_q,
            index.max_k,
            scale,
        )
    qb, kb = index.query_bounds, index.key_bounds
    pieces = []
    for s in range(len(qb) - 1):
        if qb[s + 1] == qb[s]:
            continue
        q_pos = index.position_ids[qb[s] : qb[s + 1]]
        k_pos = torch.arange(kb[s + 1] - kb[s], device=q_local.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [q, k] True = attend (global positions)
        pieces.append(
            _sdpa(
                q_local[qb[s] : qb[s + 1]],
                k[kb[s] : kb[s + 1]],
                v[kb[s] : kb[s + 1]],
                scale,
                attn_mask=mask,
            )
        )
    return torch.cat(pieces) if pieces else q_local.new_empty(q_local.shape)
