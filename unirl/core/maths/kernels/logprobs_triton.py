"""Triton kernels for `unirl.core.maths.logprobs`: per-token softmax statistics in one pass over the
logits, and the gradient in one more pass, with nothing of the logits' size in between.

Forward (one program per token row, online softmax, Milakov & Gimelshein 2018): with
``z = logits / temperature`` over the row's valid columns, it keeps a running max ``m``, the
sum ``s = sum exp(z - m)`` rescaled whenever ``m`` grows, and for entropy ``w = sum exp(z - m) z``;
it also reads the target's logit when the target falls in this vocabulary shard. These are
local statistics: `unirl.core.maths.logprobs` combines them over tensor-parallel ranks and finishes
``lse = m + log s``, ``logp = z_target - lse``, ``E[z] = w / s``, ``H = lse - E[z]``.
For a whole vocabulary `finished_stats` (the fused head's loss path) does that finish in the
kernel and writes the results.

Backward (one program per row): recomputes ``p = exp(z - lse)`` from the saved logits and the
per-token ``lse`` and writes, in the logits' dtype,
``grad = (g_logp (onehot - p) + g_entropy p (E[z] - z)) / temperature``; padded columns get 0.

Row offsets are 64-bit: 16k tokens x 152k vocabulary is past 2**31 elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _stats_fwd_kernel(
    logits_ptr,
    stride_row,
    targets_ptr,
    vocab_start,
    n_valid,
    inv_temp,
    max_ptr,
    sumexp_ptr,
    sum_pz_ptr,
    target_logit_ptr,
    BLOCK_V: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK_V)
    # scalar running sums, reduced per block: per-lane accumulators were slower on the H200
    # (register pressure at these block sizes; benchmarks/README.md)
    m = float("-inf")
    s = 0.0
    w = 0.0
    for start in range(0, n_valid, BLOCK_V):
        idx = start + cols
        valid = idx < n_valid
        z = tl.load(row_ptr + idx, mask=valid, other=float("-inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, tl.max(z, axis=0))
        # every block holds at least one valid column, so m_new is finite for finite logits
        scale = tl.exp(m - m_new)
        e = tl.exp(z - m_new)
        s = s * scale + tl.sum(e, axis=0)
        if WITH_ENTROPY:
            # masked lanes are 0 * -inf: keep them out of the sum
            w = w * scale + tl.sum(tl.where(valid, e * z, 0.0), axis=0)
        m = m_new
    tl.store(max_ptr + row, m)
    tl.store(sumexp_ptr + row, s)
    if WITH_ENTROPY:
        tl.store(sum_pz_ptr + row, w)
    t = tl.load(targets_ptr + row).to(tl.int64) - vocab_start
    own = (t >= 0) & (t < n_valid)
    zt = tl.load(row_ptr + t, mask=own, other=0.0).to(tl.float32) * inv_temp
    tl.store(target_logit_ptr + row, zt)


@triton.jit
def _stats_finish_kernel(
    logits_ptr,
    stride_row,
    targets_ptr,
    n_valid,
    inv_temp,
    logp_ptr,
    lse_ptr,
    mean_z_ptr,
    entropy_ptr,
    BLOCK_V: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
):
    """`_stats_fwd_kernel` for a whole (unsharded) vocabulary, finished in the kernel: writes
    ``logp``, ``lse`` and (for entropy) ``E[z]`` and ``H`` instead of the four local sums, so
    nothing runs between the statistics and the loss (`unirl.core.maths.head_loss`)."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK_V)
    m = float("-inf")
    s = 0.0
    w = 0.0
    for start in range(0, n_valid, BLOCK_V):
        idx = start + cols
        valid = idx < n_valid
        z = tl.load(row_ptr + idx, mask=valid, other=float("-inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, tl.max(z, axis=0))
        scale = tl.exp(m - m_new)
        e = tl.exp(z - m_new)
        s = s * scale + tl.sum(e, axis=0)
        if WITH_ENTROPY:
            w = w * scale + tl.sum(tl.where(valid, e * z, 0.0), axis=0)
        m = m_new
    lse = m + tl.log(s)
    t = tl.load(targets_ptr + row).to(tl.int64)
    own = (t >= 0) & (t < n_valid)
    zt = tl.load(row_ptr + t, mask=own, other=0.0).to(tl.float32) * inv_temp
    tl.store(logp_ptr + row, zt - lse)
    tl.store(lse_ptr + row, lse)
    if WITH_ENTROPY:
        mean_z = w / s
        tl.store(mean_z_ptr + row, mean_z)
        tl.store(entropy_ptr + row, lse - mean_z)


@triton.jit
def _grad_bwd_kernel(
    logits_ptr,
    stride_row,
    grad_ptr,
    stride_grad_row,
    targets_ptr,
    vocab_start,
    n_valid,
    n_cols,
    inv_temp,
    lse_ptr,
    mean_z_ptr,
    g_logp_ptr,
    g_entropy_ptr,
    BLOCK_V: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    grad_row_ptr = grad_ptr + row * stride_grad_row
    cols = tl.arange(0, BLOCK_V)
    lse = tl.load(lse_ptr + row)
    g = tl.load(g_logp_ptr + row)
    if WITH_ENTROPY:
        mean_z = tl.load(mean_z_ptr + row)
        g_ent = tl.load(g_entropy_ptr + row)
    t = tl.load(targets_ptr + row).to(tl.int64) - vocab_start
    for start in range(0, n_cols, BLOCK_V):
        idx = start + cols
        valid = idx < n_valid
        z = tl.load(row_ptr + idx, mask=valid, other=0.0).to(tl.float32) * inv_temp
        p = tl.where(valid, tl.exp(z - lse), 0.0)
        d = tl.where((idx == t) & valid, g, 0.0) - g * p
        if WITH_ENTROPY:
            d += g_ent * p * (mean_z - z)
        d = d * inv_temp
        tl.store(grad_row_ptr + idx, d.to(grad_ptr.dtype.element_ty), mask=idx < n_cols)


def fwd_config(n_cols: int, with_entropy: bool) -> tuple[int, int]:
    """(BLOCK_V, num_warps) of the statistics kernel for rows of ``n_cols`` columns; from the
    H200 sweep of ``benchmarks/logprobs.py --sweep`` (results in benchmarks/results): the
    entropy's extra sum runs best on smaller blocks."""
    cap, warps = (2048, 4) if with_entropy else (8192, 8)
    block_v = min(triton.next_power_of_2(max(n_cols, 1)), cap)
    return block_v, warps if block_v >= 2048 else 4


def bwd_config(n_cols: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) of the gradient kernel; from the same sweep."""
    block_v = min(triton.next_power_of_2(max(n_cols, 1)), 8192)
    return block_v, 16 if block_v >= 4096 else (8 if block_v >= 2048 else 4)


def local_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    n_valid: int,
    inv_temp: float,
    with_entropy: bool,
    config: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per-row (max, sum-exp, sum exp*z or None, target logit) over this shard's first
    ``n_valid`` columns, all fp32 ``[T]``. ``logits`` must have unit column stride."""
    n_rows = logits.shape[0]
    f32 = dict(dtype=torch.float32, device=logits.device)
    row_max = torch.empty(n_rows, **f32)
    sumexp = torch.empty(n_rows, **f32)
    sum_pz = torch.empty(n_rows, **f32) if with_entropy else None
    target_logit = torch.empty(n_rows, **f32)
    if n_rows == 0:
        return row_max, sumexp, sum_pz, target_logit
    block_v, num_warps = config or fwd_config(n_valid, with_entropy)
    _stats_fwd_kernel[(n_rows,)](
        logits,
        logits.stride(0),
        targets,
        vocab_start,
        n_valid,
        inv_temp,
        row_max,
        sumexp,
        sum_pz if with_entropy else sumexp,  # unused pointer when entropy is off
        target_logit,
        BLOCK_V=block_v,
        WITH_ENTROPY=with_entropy,
        num_warps=num_warps,
    )
    return row_max, sumexp, sum_pz, target_logit


def finished_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    n_valid: int,
    inv_temp: float,
    logp_out: torch.Tensor,
    entropy_out: torch.Tensor | None,
    config: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """For a whole vocabulary (no tensor-parallel shards): writes the rows' log-probs into
    ``logp_out`` and (when given) their entropy into ``entropy_out`` (fp32 ``[T]``, unit stride),
    and returns ``(lse, E[z] or None)`` for the gradient, in one kernel."""
    n_rows = logits.shape[0]
    with_entropy = entropy_out is not None
    lse = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    mean_z = torch.empty_like(lse) if with_entropy else None
    for out in (logp_out, entropy_out):
        assert out is None or (out.dtype == torch.float32 and out.shape == (n_rows,))
    if n_rows == 0:
        return lse, mean_z
    block_v, num_warps = config or fwd_config(n_valid, with_entropy)
    _stats_finish_kernel[(n_rows,)](
        logits,
        logits.stride(0),
        targets,
        n_valid,
        inv_temp,
        logp_out,
        lse,
        mean_z if with_entropy else lse,  # unused pointers when entropy is off
        entropy_out if with_entropy else lse,
        BLOCK_V=block_v,
        WITH_ENTROPY=with_entropy,
        num_warps=num_warps,
    )
    return lse, mean_z


def logits_grad(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    n_valid: int,
    inv_temp: float,
    lse: torch.Tensor,
    g_logp: torch.Tensor,
    mean_z: torch.Tensor | None,
    g_entropy: torch.Tensor | None,
    config: tuple[int, int] | None = None,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gradient w.r.t. ``logits`` in ``out_dtype`` (default: the logits' dtype), one fresh
    buffer, or written into ``out`` (``out=logits`` overwrites the logits in place: each program
    reads a block of its row before writing that block); the entropy term only when
    ``g_entropy`` is given (then ``mean_z`` must be too)."""
    n_rows, n_cols = logits.shape
    if out is None:
        out = torch.empty((n_rows, n_cols), dtype=out_dtype or logits.dtype, device=logits.device)
    assert out.shape == logits.shape and out.stride(1) == 1
    grad = out
    if n_rows == 0:
        return grad
    with_entropy = g_entropy is not None
    block_v, num_warps = config or bwd_config(n_cols)
    _grad_bwd_kernel[(n_rows,)](
        logits,
        logits.stride(0),
        grad,
        grad.stride(0),
        targets,
        vocab_start,
        n_valid,
        n_cols,
        inv_temp,
        lse,
        mean_z if with_entropy else lse,
        g_logp,
        g_entropy if with_entropy else g_logp,
        BLOCK_V=block_v,
        WITH_ENTROPY=with_entropy,
        num_warps=num_warps,
    )
    return grad
