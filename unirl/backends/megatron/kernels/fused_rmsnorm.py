"""RMSNorm forward and backward in one pass each, for megatron's local spec on CUDA.

megatron-core 0.16.1's local spec builds ``torch.nn.RMSNorm`` (``transformer/torch_norm.py``),
whose CUDA backward is two kernels, the input gradient and the weight gradient
(``GammaBetaBackward``, a column reduction over every token), each reading ``x`` and ``dy``
from memory. At the 1.5B benchmark's shape (16,384 tokens x 1,536 bf16, one H200, L2 flushed
as in a step) torch's forward + backward took 146 us of kernel time, 59 ms of the step over its
513 norms; these kernels take 88 us (`benchmarks/megatron_kernels.py`), and 78 us against 315
for Qwen3's per-head q / k norms (rows of 128).

`rms_norm` computes what torch's fused RMSNorm computes (fp32 statistics and products, one
rounding at each store): the forward keeps each row's ``rstd`` (fp32) for the backward, and the
backward makes ``dx`` and each program's fp32 partial of the weight gradient from one load of
``x`` and ``dy`` per row block (a persistent grid of a few programs per SM), then sums the
partials (a ``[programs, N]`` fp32 tensor, small beside the activations). `TritonRMSNorm` is
``torch.nn.RMSNorm`` with that forward on CUDA tensors (the same parameters and state dict);
`convert` gives it to a built model's norms (`unirl.backends.megatron.kernels.gpu_fusions` does, where
its probe has checked the kernels on the GPU). Anything the kernels do not cover (CPU tensors,
a normalised shape of more than one dim, no weight, mixed dtypes, rows wider than `MAX_WIDTH`)
runs torch's own forward.
"""

from __future__ import annotations

import functools
import logging

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU tier: torch's own RMSNorm runs
    triton = None
    tl = None

logger = logging.getLogger(__name__)

# widest row one program holds in registers (fp32, a few values per element)
MAX_WIDTH = 16384
# elements of a row block: rows per program = this / the row's padded width
_BLOCK_ELEMENTS = 2048
# backward programs per SM (each loops over row blocks, keeping its weight-gradient partial)
_PROGRAMS_PER_SM = 8

if triton is not None:

    @triton.jit
    def _rms_fwd_kernel(
        x_ptr,
        w_ptr,
        y_ptr,
        rstd_ptr,
        rows,
        width,
        eps,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        c = tl.arange(0, BLOCK_N)
        rmask = r < rows
        cmask = c < width
        mask = rmask[:, None] & cmask[None, :]
        offs = r.to(tl.int64)[:, None] * width + c[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + c, mask=cmask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / width + eps)
        y = x * rstd[:, None] * w[None, :]
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + r, rstd, mask=rmask)

    @triton.jit
    def _rms_bwd_kernel(
        dy_ptr,
        x_ptr,
        w_ptr,
        rstd_ptr,
        dx_ptr,
        dw_part_ptr,
        rows,
        width,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        pid = tl.program_id(0)
        step = tl.num_programs(0) * BLOCK_M
        c = tl.arange(0, BLOCK_N)
        cmask = c < width
        w = tl.load(w_ptr + c, mask=cmask, other=0.0).to(tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(pid * BLOCK_M, rows, step):
            r = start + tl.arange(0, BLOCK_M)
            rmask = r < rows
            mask = rmask[:, None] & cmask[None, :]
            offs = r.to(tl.int64)[:, None] * width + c[None, :]
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + r, mask=rmask, other=0.0)
            xh = x * rstd[:, None]
            g = dy * w[None, :]
            mean_gx = tl.sum(g * xh, axis=1) / width
            dx = (g - xh * mean_gx[:, None]) * rstd[:, None]
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            acc += dy * xh
        tl.store(dw_part_ptr + pid * width + c, tl.sum(acc, axis=0), mask=cmask)


def _blocks(width: int) -> tuple[int, int, int]:
    """(rows per block, padded width, warps) for rows of ``width``."""
    block_n = triton.next_power_of_2(width)
    block_m = max(1, _BLOCK_ELEMENTS // block_n)
    warps = 8 if block_m * block_n >= 4096 else 4
    return block_m, block_n, warps


@functools.cache
def _programs(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count * _PROGRAMS_PER_SM


def _forward(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    rows, width = x.shape
    y = torch.empty_like(x)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    block_m, block_n, warps = _blocks(width)
    if rows:
        _rms_fwd_kernel[(triton.cdiv(rows, block_m),)](
            x, w, y, rstd, rows, width, eps, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps
        )
    return y, rstd


def _backward(
    dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, width = x.shape
    dx = torch.empty_like(x)
    block_m, block_n, warps = _blocks(width)
    programs = max(1, min(_programs(x.device), triton.cdiv(rows, block_m)))
    part = torch.empty(programs, width, dtype=torch.float32, device=x.device)
    if rows:
        _rms_bwd_kernel[(programs,)](
            dy, x, w, rstd, dx, part, rows, width, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps
        )
    else:
        part.zero_()
    return dx, part.sum(dim=0).to(w.dtype)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        y, rstd = _forward(x2, w.contiguous(), eps)
        ctx.save_for_backward(x2, w, rstd)
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        x2, w, rstd = ctx.saved_tensors
        dx, dw = _backward(dy.reshape(x2.shape).contiguous(), x2, w.contiguous(), rstd)
        return dx.view(dy.shape), dw, None


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x**2, -1) + eps) * w`` over the last dim (CUDA)."""
    return _RMSNormFunction.apply(x, w, eps)


def fused_path_refusal(x: torch.Tensor, norm: torch.nn.RMSNorm) -> str | None:
    """None when `rms_norm` computes ``norm(x)``, else why not."""
    w = norm.weight
    if triton is None:
        return "Triton is not installed"
    if not x.is_cuda:
        return f"input on {x.device}"
    if w is None:
        return "no weight (elementwise_affine=False)"
    if len(norm.normalized_shape) != 1 or norm.normalized_shape[0] > MAX_WIDTH:
        return f"normalized shape {tuple(norm.normalized_shape)} (one dim of at most {MAX_WIDTH})"
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or w.dtype != x.dtype:
        return f"dtypes {x.dtype} (input) / {w.dtype} (weight)"
    return None


class TritonRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` whose forward is `rms_norm` where `fused_path_refusal` allows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_path_refusal(x, self) is not None:
            return super().forward(x)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return rms_norm(x, self.weight, eps)


def convert(model: torch.nn.Module) -> int:
    """Every ``torch.nn.RMSNorm`` of ``model`` (that class exactly) becomes a `TritonRMSNorm`
    in place: the same module object, parameters, hooks and state dict. Returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.RMSNorm:
            module.__class__ = TritonRMSNorm
            count += 1
    return count
