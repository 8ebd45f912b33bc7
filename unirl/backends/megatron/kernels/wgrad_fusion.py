"""Megatron's gradient-accumulation fusion without Apex: the weight-gradient matmul of every
linear layer adds its product straight into the fp32 ``main_grad`` of megatron's DDP.

Without it (``gradient_accumulation_fusion=False``, megatron-core's only choice when Apex's
``fused_weight_gradient_mlp_cuda`` extension is absent) each backward writes a bf16 weight
gradient, and DDP's hook then reads it and adds it to ``main_grad``: an extra pass over every
weight per microbatch (``aten::add_`` was 3% of the 1.5B Megatron step's GPU time on one H200,
besides the bf16 rounding of each microbatch's gradient before it is summed). torch's CUDA
``addmm`` with ``out_dtype=torch.float32`` computes ``C + A @ B`` from bf16 operands with fp32
accumulation into an fp32 output, which is what the extension's ``wgrad_gemm_accum_fp32`` does.

megatron-core 0.16.1 reads the extension as ``tensor_parallel/layers.py``'s module global
``fused_weight_gradient_mlp_cuda`` (line 569: ``wgrad_gemm_accum_fp32(total_input, grad_output,
weight.main_grad)``; line 573: the fp16/bf16 variant) and refuses the config when
``_grad_accum_fusion_available`` (line 44) is false (line 924). `install` binds both, checked
against `CHECKED_VERSIONS`, after a probe on the current GPU has matched a float64 reference.
CUDA only: the CPU has no ``addmm`` with ``out_dtype``, so CPU runs keep the unfused path.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

logger = logging.getLogger(__name__)

# The megatron-core versions whose layers.py lines named above were read.
CHECKED_VERSIONS = ("0.16.1",)

_state: dict[str, bool | None] = {"installed": None}


def wgrad_gemm_accum_fp32(
    total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor
) -> None:
    """``main_grad += grad_output^T @ total_input``: bf16 operands, fp32 accumulate and output
    (fp32 operands, an fp32 model: a plain in-place addmm)."""
    if total_input.dtype == torch.float32:
        main_grad.addmm_(grad_output.t(), total_input)
        return
    torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=torch.float32, out=main_grad)


def wgrad_gemm_accum_fp16(
    total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor
) -> None:
    """The same for a bf16 / fp16 ``main_grad`` (DDP's ``grad_reduce_in_fp32`` off)."""
    main_grad.addmm_(grad_output.t(), total_input)


EXTENSION = SimpleNamespace(
    wgrad_gemm_accum_fp32=wgrad_gemm_accum_fp32, wgrad_gemm_accum_fp16=wgrad_gemm_accum_fp16
)


def probe(device: torch.device) -> str | None:
    """None when the fused accumulation on ``device`` matches float64, else why not."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(256, 64, generator=gen).to(device, torch.bfloat16)
    g = torch.randn(256, 96, generator=gen).to(device, torch.bfloat16)
    acc = torch.randn(96, 64, generator=gen).to(device, torch.float32)
    want = acc.double() + g.double().t() @ x.double()
    try:
        wgrad_gemm_accum_fp32(x, g, acc)
    except (RuntimeError, TypeError) as exc:  # an addmm without out_dtype / aliasing out
        return f"torch.addmm(out_dtype=float32, out=C) failed: {exc}"
    err = (acc.double() - want).abs().max().item() / want.abs().max().item()
    if not err < 1e-4:  # fp32 accumulation; a bf16-rounded product would be near 4e-3
        return f"torch.addmm(out_dtype=float32) differs from float64 by {err:.2e} (relative)"
    return None


def install() -> bool:
    """Bind the extension for megatron-core (idempotent). True when linear layers built from now
    on may set ``gradient_accumulation_fusion``: on CUDA, the probe passed, Apex absent or
    present alike (with Apex, megatron-core already has the extension and nothing is bound)."""
    if _state["installed"] is not None:
        return bool(_state["installed"])
    from megatron.core import package_info
    from megatron.core.tensor_parallel import layers

    if layers._grad_accum_fusion_available:
        _state["installed"] = True  # Apex's extension imported
        return True
    why = None
    if not torch.cuda.is_available():
        why = "no CUDA device"
    elif package_info.__version__ not in CHECKED_VERSIONS:
        why = (
            f"megatron-core {package_info.__version__}; unirl/backends/megatron/kernels/wgrad_fusion.py "
            f"was checked against {', '.join(CHECKED_VERSIONS)}"
        )
    else:
        why = probe(torch.device("cuda", torch.cuda.current_device()))
    if why is not None:
        logger.info("gradient accumulation fusion off: %s", why)
        _state["installed"] = False
        return False
    layers.fused_weight_gradient_mlp_cuda = EXTENSION
    layers._grad_accum_fusion_available = True
    logger.info(
        "gradient accumulation fusion on: torch.addmm(out_dtype=float32) into main_grad "
        "(unirl.backends.megatron.kernels.wgrad_fusion)"
    )
    _state["installed"] = True
    return True
