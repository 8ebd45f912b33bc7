"""RMSNorm forward and backward in Triton for the local layer spec's torch norms, on CUDA.

Without TE or Apex, every norm of megatron-core's local spec is a ``torch.nn.RMSNorm`` (through
``WrappedTorchNorm``). Its CUDA backward is two kernels: the input gradient, then the weight
gradient as a column reduction over all tokens in 48 blocks; on the 1.5B benchmark (16,384 x
1,536 bf16, one H200) they took 46 + 65 us per norm and microbatch, where reading ``x`` and
``dy`` and writing ``dx`` once takes about 40 us.

`TritonRMSNorm` is ``torch.nn.RMSNorm`` (same parameter, same state dict) whose forward on CUDA
runs `RMSNormFunction`: the forward keeps the per-row ``1 / rms`` (4 bytes a token); the
backward makes ``dx`` and a per-program partial weight gradient in one pass over the rows (fp32),
summed after. Maths in fp32 with one rounding at the store, as torch's kernel. `swap_norms`
changes the class of a model's ``torch.nn.RMSNorm`` modules (unirl's model build calls it where
`unirl.backends.megatron.gpu_fusions` installed its kernels); anything else (CPU tensors, other
dtypes, no weight, a weight of another dtype) runs torch's own forward.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU tier: torch's own norm runs
    triton = None
    tl = None

if triton is not None:

    @triton.jit
    def _rms_forward(x_ptr, w_ptr, y_ptr, rstd_ptr, width, stride_x, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        col = tl.arange(0, BLOCK)
        mask = col < width
        x = tl.load(x_ptr + row * stride_x + col, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + col, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + eps)
        tl.store(y_ptr + row * width + col, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + row, rstd)

    @triton.jit
    def _rms_backward(
        dy_ptr,
        x_ptr,
        w_ptr,
        rstd_ptr,
        dx_ptr,
        dw_ptr,
        rows,
        width,
        stride_dy,
        stride_x,
        programs,
        iters,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        first = pid.to(tl.int64)  # row offsets in int64: rows x width may pass 2^31
        col = tl.arange(0, BLOCK)
        in_row = col < width
        w = tl.load(w_ptr + col, mask=in_row, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK,), dtype=tl.float32)
        for i in range(0, iters):  # rows pid, pid + programs, ... (the last may be past the end)
            row = first + i * programs
            mask = col < tl.where(row < rows, width, 0)  # nothing of a row past the end
            x = tl.load(x_ptr + row * stride_x + col, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * stride_dy + col, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row, mask=row < rows, other=0.0)
            xhat = x * rstd
            wdy = dy * w
            # d/dx of x * rstd: rstd * (w dy - xhat * mean(xhat * w dy))
            dot = tl.sum(xhat * wdy, axis=0) / width
            dx = (wdy - xhat * dot) * rstd
            tl.store(dx_ptr + row * width + col, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dw += dy * xhat
        tl.store(dw_ptr + pid * width + col, dw, mask=in_row)


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    t = t.reshape(-1, width)
    return t if t.stride(-1) == 1 else t.contiguous()


class RMSNormFunction(torch.autograd.Function):
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dimension."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        width = x.shape[-1]
        x2 = _rows(x, width)
        y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(width)
        if x2.shape[0]:
            _rms_forward[(x2.shape[0],)](
                x2, weight, y, rstd, width, x2.stride(0), eps, BLOCK=block, num_warps=8
            )
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x2, weight, rstd = ctx.saved_tensors
        rows, width = x2.shape
        dy = _rows(grad, width)
        dx = torch.empty(x2.shape, dtype=x2.dtype, device=x2.device)
        props = torch.cuda.get_device_properties(x2.device)
        programs = max(1, min(rows, 2 * props.multi_processor_count))
        partial = torch.empty(programs, width, dtype=torch.float32, device=x2.device)
        if rows:
            _rms_backward[(programs,)](
                dy,
                x2,
                weight,
                rstd,
                dx,
                partial,
                rows,
                width,
                dy.stride(0),
                x2.stride(0),
                programs,
                triton.cdiv(rows, programs),
                BLOCK=triton.next_power_of_2(width),
                num_warps=8,
            )
        else:
            partial.zero_()
        return dx.view(ctx.shape), partial.sum(0).to(weight.dtype), None


class TritonRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` running `RMSNormFunction` where it covers the call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (
            triton is None
            or w is None
            or not x.is_cuda
            or len(self.normalized_shape) != 1
            or x.dtype not in (torch.bfloat16, torch.float16, torch.float32)
            or w.dtype != x.dtype
        ):
            return super().forward(x)
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps  # torch's default
        return RMSNormFunction.apply(x, w, eps)


def swap_norms(model: torch.nn.Module) -> int:
    """Make every ``torch.nn.RMSNorm`` of ``model`` a `TritonRMSNorm` (its parameter, hooks
    and attributes, such as the ``sequence_parallel`` mark, untouched); how many."""
    swapped = 0
    for module in model.modules():
        if type(module) is torch.nn.RMSNorm:
            module.__class__ = TritonRMSNorm
            swapped += 1
    return swapped
