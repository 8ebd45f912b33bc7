"""Megatron's RoPE on packed (THD) input in one Triton kernel per tensor, forward and backward.

Without Transformer Engine, megatron-core 0.16.1 rotates q and k of packed sequences with
``rope_utils._apply_rotary_pos_emb_thd``: per call it splits the tokens by sequence, concatenates
the frequency rows, takes ``cos`` / ``sin``, and applies ``t * cos + rotate_half(t) * sin`` with a
chunk, a negation, two concatenations, two multiplications and an addition, each a pass over the
tensor (broadcast, so not vectorised); autograd replays as many passes backward. On the 1.5B
packed benchmark (one H200) that was about 0.9 ms per layer and microbatch, 230 ms of a 3.3 s step.

`apply_rotary_pos_emb_thd` (installed by `unirl.backends.megatron.kernels.gpu_fusions` in place of
megatron's function, on CUDA only) does the same maths in one kernel per tensor:

- the rows of ``freqs`` each local token reads (`thd_freq_rows`: megatron's per-sequence choice,
  context-parallel chunks and the offset mode included) and the ``cos`` / ``sin`` tables in the
  tensor's dtype (megatron's ``(cos(freqs) * mscale).to(t.dtype)``) are built once per
  microbatch and shared by q, k and every layer (`rope_tables`, cached on the boundaries);
- the kernel reads each element of ``t`` once and writes the output once; the backward kernel
  does the same for the gradient (``dt = g * cos + rotate_half^T(g * sin)``). q and k of one
  layer at 16,384 tokens (12 / 2 heads of 128, one H200): 0.135 ms forward against megatron's
  0.80 ms (`benchmarks/megatron_kernels.py`);
- in bf16 each product is rounded to bf16 before the sum, as megatron's eager bf16 ops round
  them, so bf16 outputs and gradients equal megatron's bit for bit (fp32: up to the last bit,
  where the compiler fuses a multiply-add; fp16 goes to megatron's function).

Why not Liger's ``LigerRopeFunction``: it computes in fp32 without those roundings (its bf16
results differ from megatron's in the last bit, so the backends' losses would no longer be
identical), takes q and k together in the HF layout with position ids, and is an optional extra.

Anything else (interleaved or partial rotary, multi-latent attention, ``freqs`` with batch or
multimodal dimensions, CPU tensors, no Triton) goes to megatron's own function unchanged.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from unirl.backends.microbatch import to_device_async

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU tier: megatron's own function runs
    triton = None
    tl = None

# ``rope_utils._apply_rotary_pos_emb_thd`` as megatron-core defined it (set by gpu_fusions)
ORIGINAL: dict[str, Callable[..., torch.Tensor]] = {}


def thd_freq_rows(
    cu_seqlens: Sequence[int], *, cp_size: int, cp_rank: int, offsets: bool
) -> torch.Tensor:
    """The row of ``freqs`` that each token of this rank's packed stream reads (int64, host).

    ``cu_seqlens`` are the global boundaries (megatron divides each length by ``cp_size``).
    megatron's `_get_thd_freqs_on_this_cp_rank`, per sequence of local length ``n``: positions
    ``[0, n)`` when cp == 1; under CP the rank's two chunks of ``c = n // 2`` tokens read
    ``[r*c, (r+1)*c)`` and ``[F - (r+1)*c, F - r*c)``, ``F = cp * n``. With ``offsets`` (``freqs``
    has one row per token of the whole batch) each sequence's rows start at its global start.
    """
    rows = []
    for start, end in itertools.pairwise(cu_seqlens):
        n = (end - start) // cp_size
        base = start if offsets else 0
        if cp_size == 1:
            rows.append(torch.arange(base, base + n))
            continue
        chunk, full = n // 2, cp_size * n
        rows.append(torch.arange(base + cp_rank * chunk, base + (cp_rank + 1) * chunk))
        rows.append(
            torch.arange(base + full - (cp_rank + 1) * chunk, base + full - cp_rank * chunk)
        )
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)


def rope_tables(
    freqs: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype, mscale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` ``[T, D]`` in ``dtype`` for the given ``freqs`` rows: megatron's
    ``(torch.cos(freqs_packed) * mscale).to(t.dtype)``, the same values."""
    packed = freqs.reshape(freqs.shape[0], freqs.shape[-1])[to_device_async(rows, freqs.device)]
    return (torch.cos(packed) * mscale).to(dtype), (torch.sin(packed) * mscale).to(dtype)


# one entry per microbatch: q and k of every layer share it (a few MiB at 16k tokens)
_TABLES: collections.OrderedDict[tuple[Any, ...], tuple[torch.Tensor, ...]] = (
    collections.OrderedDict()
)
_TABLES_KEPT = 4


def _cached_tables(
    freqs: torch.Tensor,
    bounds: list[int],
    cp_size: int,
    cp_rank: int,
    dtype: torch.dtype,
    mscale: float,
    tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    # tables made under inference mode cannot be saved for a later backward: kept apart
    inference = torch.is_inference_mode_enabled()
    key = (id(freqs), tuple(bounds), cp_size, cp_rank, dtype, float(mscale), inference)
    hit = _TABLES.get(key)
    if hit is not None and hit[0] is freqs:  # the entry holds freqs, so its id is not reused
        _TABLES.move_to_end(key)
        return hit[1], hit[2]
    offsets = freqs.shape[0] == bounds[-1]  # megatron's test for its "exact mapping" mode
    rows = thd_freq_rows(bounds, cp_size=cp_size, cp_rank=cp_rank, offsets=offsets)
    if rows.numel() != tokens:
        raise ValueError(
            f"packed RoPE: cu_seqlens {bounds} give {rows.numel()} tokens on context-parallel "
            f"rank {cp_rank} of {cp_size}, the tensor has {tokens}"
        )
    cos, sin = rope_tables(freqs, rows, dtype, mscale)
    _TABLES[key] = (freqs, cos, sin)
    while len(_TABLES) > _TABLES_KEPT:
        _TABLES.popitem(last=False)
    return cos, sin


if triton is not None:

    @triton.jit
    def _round_bf16(x):
        """fp32 -> the nearest bf16 (ties to even), back in fp32, by the bits: a cast there and
        back is folded away by the compiler (measured on an H200: 15% of outputs an ulp off)."""
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _rope_kernel(
        x_ptr,
        cos_ptr,
        sin_ptr,
        out_ptr,
        tokens,
        heads,
        stride_xt,
        stride_xh,
        HALF: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BACKWARD: tl.constexpr,
        ROUND: tl.constexpr,
    ):
        """Forward: ``o1 = x1 c1 - x2 s1``, ``o2 = x2 c2 + x1 s2`` (halves 1, 2 of the head dim).
        Backward (x is the gradient): ``d1 = g1 c1 + g2 s2``, ``d2 = g2 c2 - g1 s1``. In bf16
        each product is rounded first, as megatron's eager ops do."""
        dtype = out_ptr.dtype.element_ty
        t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None, None]
        h = tl.arange(0, BLOCK_H)[None, :, None]
        d = tl.arange(0, BLOCK_D)[None, None, :]
        mask_td = (t < tokens) & (d < HALF)
        mask = mask_td & (h < heads)
        x = x_ptr + t * stride_xt + h * stride_xh + d
        x1 = tl.load(x, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x + HALF, mask=mask, other=0.0).to(tl.float32)
        table = t * (2 * HALF) + d
        c1 = tl.load(cos_ptr + table, mask=mask_td, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + table + HALF, mask=mask_td, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + table, mask=mask_td, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + table + HALF, mask=mask_td, other=0.0).to(tl.float32)
        a1 = x1 * c1
        a2 = x2 * c2
        if BACKWARD:
            b1 = x2 * s2
            b2 = x1 * s1
        else:
            b1 = x2 * s1
            b2 = x1 * s2
        if ROUND:  # bf16: each product rounded, as megatron's eager bf16 multiplications
            a1, a2, b1, b2 = _round_bf16(a1), _round_bf16(a2), _round_bf16(b1), _round_bf16(b2)
        if BACKWARD:
            o1 = a1 + b1
            o2 = a2 - b2
        else:
            o1 = a1 - b1
            o2 = a2 + b2
        if ROUND:  # and the sum (the store's cast is then exact, however it rounds)
            o1, o2 = _round_bf16(o1), _round_bf16(o2)
        out = out_ptr + t * (heads * 2 * HALF) + h * (2 * HALF) + d
        tl.store(out, o1.to(dtype), mask=mask)
        tl.store(out + HALF, o2.to(dtype), mask=mask)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """One kernel launch: ``x [T, H, D]`` (last dim contiguous) -> a contiguous ``[T, H, D]``."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    tokens, heads, dim = x.shape
    out = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    block_h = triton.next_power_of_2(heads)
    block_d = triton.next_power_of_2(dim // 2)
    block_t = max(1, min(64, 4096 // (block_h * block_d)))  # about 4k elements per program
    _rope_kernel[(triton.cdiv(tokens, block_t),)](
        x,
        cos,
        sin,
        out,
        tokens,
        heads,
        x.stride(0),
        x.stride(1),
        HALF=dim // 2,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        BACKWARD=backward,
        ROUND=x.dtype == torch.bfloat16,
        num_warps=4,
    )
    return out


class PackedRope(torch.autograd.Function):
    """``t [T, H, D]`` rotated by per-token ``cos`` / ``sin`` tables ``[T, D]``."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(t, cos, sin, backward=False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, backward=True), None, None


def fused_path_refusal(
    t: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool, multi_latent_attention: bool
) -> str | None:
    """None when the fused kernel computes megatron's result for these arguments, else why not."""
    if triton is None:
        return "Triton is not installed"
    if not t.is_cuda:
        return "the tensor is not on a CUDA device"
    if rotary_interleaved or multi_latent_attention:
        return "interleaved rotary / multi-latent attention"
    if t.dim() != 3 or t.dtype not in (torch.bfloat16, torch.float32):
        return f"tensor {tuple(t.shape)} {t.dtype}"
    if freqs.dim() != 4 or freqs.shape[1] != 1 or freqs.shape[2] != 1 or freqs.requires_grad:
        return f"freqs {tuple(freqs.shape)} (batch / multimodal dimensions or a gradient)"
    if freqs.shape[-1] != t.shape[-1] or t.shape[-1] % 2:
        return f"partial rotary: freqs dim {freqs.shape[-1]}, head dim {t.shape[-1]}"
    return None


def apply_rotary_pos_emb_thd(
    t: torch.Tensor,
    cu_seqlens: torch.Tensor,
    freqs: torch.Tensor,
    rotary_interleaved: bool = False,
    multi_latent_attention: bool = False,
    mscale: float = 1.0,
    cp_group: Any = None,
) -> torch.Tensor:
    """megatron-core's ``_apply_rotary_pos_emb_thd`` (same signature and result), fused where
    `fused_path_refusal` allows it, megatron's own function otherwise."""
    if cp_group is None or fused_path_refusal(t, freqs, rotary_interleaved, multi_latent_attention):
        return ORIGINAL["_apply_rotary_pos_emb_thd"](
            t,
            cu_seqlens,
            freqs,
            rotary_interleaved=rotary_interleaved,
            multi_latent_attention=multi_latent_attention,
            mscale=mscale,
            cp_group=cp_group,
        )
    bounds = cu_seqlens.tolist()  # megatron reads them so too (unirl keeps them on the host)
    cos, sin = _cached_tables(
        freqs, bounds, cp_group.size(), cp_group.rank(), t.dtype, mscale, t.shape[0]
    )
    return PackedRope.apply(t, cos, sin)
