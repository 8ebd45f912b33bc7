"""The SwiGLU backward of megatron's ``bias_activation_fusion`` in one pass near the bandwidth
floor.

megatron-core 0.16.1's ``fused_bias_swiglu.swiglu_back(g, y)`` returns
``cat(g * sigmoid(y1) * (1 + y1 * (1 - sigmoid(y1))) * y2, g * silu(y1))``, compiled by
``torch.compile``. In the 1.5B benchmark's profile (16,384 x 2 x 8,960 bf16, one H200) its
compiled kernel took 0.61 ms per layer and microbatch, about 2.4 TB/s for the 1.47 GB it must
move (read ``g``, ``y1``, ``y2``; write both halves), while the forward ran at 4.5 TB/s.

`swiglu_back` (installed by `unirl.backends.megatron.kernels.gpu_fusions` in place of megatron's, on
CUDA only) computes both halves of a column block from one load of ``g``, ``y1``, ``y2``, in
fp32 with one rounding at the store (as the compiled region does): 0.40 ms (3.7 TB/s) at that
shape on the H200 (`benchmarks/megatron_kernels.py`), equal to megatron's result there. CPU
tensors, mixed dtypes and a missing Triton go to megatron's own function. The biased and the
weighted variants (``bias_swiglu_back``, ``weighted_swiglu_back``) call it too: it is excluded
from their ``torch.compile`` graph, which breaks there and runs it eagerly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU tier: megatron's own function runs
    triton = None
    tl = None

# ``fused_bias_swiglu.swiglu_back`` as megatron-core defined it (set by gpu_fusions)
ORIGINAL: dict[str, Callable[..., torch.Tensor]] = {}

BLOCK = 1024

if triton is not None:

    @triton.jit
    def _swiglu_back_kernel(
        g_ptr, y_ptr, out_ptr, width, stride_g, stride_y, BLOCK_F: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        mask = col < width
        g = tl.load(g_ptr + row * stride_g + col, mask=mask, other=0.0).to(tl.float32)
        y1 = tl.load(y_ptr + row * stride_y + col, mask=mask, other=0.0).to(tl.float32)
        y2 = tl.load(y_ptr + row * stride_y + width + col, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(y1)
        d1 = g * sig * (1.0 + y1 * (1.0 - sig)) * y2
        d2 = g * (y1 * sig)
        dtype = out_ptr.dtype.element_ty
        out = out_ptr + row * (2 * width) + col
        tl.store(out, d1.to(dtype), mask=mask)
        tl.store(out + width, d2.to(dtype), mask=mask)


def fused_path_refusal(g: torch.Tensor, y: torch.Tensor) -> str | None:
    """None when the kernel computes megatron's result for these arguments, else why not."""
    if triton is None:
        return "Triton is not installed"
    if not (g.is_cuda and y.is_cuda):
        return "the tensors are not on a CUDA device"
    if g.dtype != y.dtype or y.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtypes {g.dtype}, {y.dtype}"
    if y.dim() != 2 or g.shape != (y.shape[0], y.shape[1] // 2) or y.shape[1] % 2:
        return f"shapes g {tuple(g.shape)}, y {tuple(y.shape)}"
    return None


@torch.compiler.disable  # a graph break where a compiled megatron function calls it
def swiglu_back(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """megatron-core's ``swiglu_back(g, y)``: the gradient of ``silu(y1) * y2`` w.r.t.
    ``y = [y1, y2]`` (``[N, 2F]``) given ``g`` (``[N, F]``)."""
    if fused_path_refusal(g, y):
        return ORIGINAL["swiglu_back"](g, y)
    if g.stride(-1) != 1:
        g = g.contiguous()
    if y.stride(-1) != 1:
        y = y.contiguous()
    rows, width = g.shape
    out = torch.empty((rows, 2 * width), dtype=y.dtype, device=y.device)
    if rows and width:
        _swiglu_back_kernel[(rows, triton.cdiv(width, BLOCK))](
            g, y, out, width, g.stride(0), y.stride(0), BLOCK_F=BLOCK, num_warps=4
        )
    return out
