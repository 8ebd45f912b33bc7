"""A linear layer's bias added inside its matmul (cuBLAS's bias epilogue), for megatron's
tensor-parallel linear layers without Transformer Engine.

megatron-core 0.16.1's ``LinearWithGradAccumulationAndAsyncCommunication.forward``
(``tensor_parallel/layers.py:488-490``; ``LinearWithFrozenWeight.forward``, lines 341-343, alike
for frozen weights: the reference model) computes ``output = torch.matmul(total_input,
weight.t())`` and then ``output = output + bias``: a second pass over the whole output. Qwen2's
fused qkv projection has a bias; in the 1.5B benchmark's profile (16,384 tokens x 2,048 outputs
bf16, one H200) that add was a broadcasting elementwise kernel of 90 us per layer and
microbatch, 23 ms of the step. ``torch.addmm(bias, input, weight.t())`` adds the bias in the
matmul's epilogue, to the fp32 accumulator before the one rounding of the output (the plain
path rounds the product, adds, and rounds again): 140 us for the pair where matmul + add took
224 us.

`LinearWithBiasEpilogue` and `FrozenLinearWithBiasEpilogue` are those classes with this forward
(installed by `unirl.backends.megatron.kernels.gpu_fusions` as the module globals that
``linear_with_grad_accumulation_and_async_allreduce`` applies, ``layers.py:745`` and ``:440``);
their backward is megatron's, unchanged. Calls with sequence parallel (the input is all-gathered
first) or without a bias go to megatron's own forward.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel import layers

# megatron-core's classes, as imported (their forwards serve the calls these hand back)
ORIGINAL = layers.LinearWithGradAccumulationAndAsyncCommunication
ORIGINAL_FROZEN = layers.LinearWithFrozenWeight
# the module globals as gpu_fusions found them, by name (restored when its probe fails)
ORIGINALS: dict[str, type] = {}


def _fused(bias: torch.Tensor | None, input: torch.Tensor, sequence_parallel: bool) -> bool:
    return bias is not None and not sequence_parallel and input.dim() >= 2


def _addmm(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``input @ weight.T + bias`` over the last dim, the bias in the matmul's epilogue."""
    out = torch.addmm(bias, input.reshape(-1, input.shape[-1]), weight.t())
    return out.view(*input.shape[:-1], weight.shape[0])


class LinearWithBiasEpilogue(ORIGINAL):  # type: ignore[misc, valid-type]
    """See the module docstring."""

    @staticmethod
    @layers.custom_fwd
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        gradient_accumulation_fusion: bool,
        allreduce_dgrad: bool,
        sequence_parallel: bool,
        grad_output_buffer: Any,
        wgrad_deferral_limit: int,
        tp_group: Any,
    ) -> torch.Tensor:
        args = (
            input,
            weight,
            bias,
            gradient_accumulation_fusion,
            allreduce_dgrad,
            sequence_parallel,
            grad_output_buffer,
            wgrad_deferral_limit,
            tp_group,
        )
        if not _fused(bias, input, sequence_parallel):
            return ORIGINAL.forward(ctx, *args)
        # megatron-core 0.16.1's forward (layers.py:448-491) without sequence parallel, but the
        # matmul
        if gradient_accumulation_fusion and hasattr(weight, "main_grad"):
            main_grad = weight.main_grad
        else:
            main_grad = None
        ctx.save_for_backward(input, weight)
        ctx.main_grad = main_grad
        ctx.use_bias = True
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.sequence_parallel = sequence_parallel
        ctx.wgrad_deferral_limit = wgrad_deferral_limit
        ctx.grad_output_buffer = grad_output_buffer
        ctx.tp_group = tp_group
        return _addmm(input, weight, bias)


class FrozenLinearWithBiasEpilogue(ORIGINAL_FROZEN):  # type: ignore[misc, valid-type]
    """See the module docstring."""

    @staticmethod
    @layers.custom_fwd
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        allreduce_dgrad: bool,
        tp_group: Any,
    ) -> torch.Tensor:
        if not _fused(bias, input, False):
            return ORIGINAL_FROZEN.forward(ctx, input, weight, bias, allreduce_dgrad, tp_group)
        # megatron-core 0.16.1's forward (layers.py:336-344), but the matmul
        ctx.save_for_backward(weight)
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.tp_group = tp_group
        return _addmm(input, weight, bias)
