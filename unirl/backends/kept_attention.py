"""Activation recompute that keeps each layer's attention output (``model.recompute_attention:
false``), shared by the Megatron layers (`keep_attention_layers` in
`unirl.backends.megatron.role_model`) and the Hugging Face backends' decoder layers
(`enable_checkpointing` in `unirl.backends.causal_lm`).

Why: whole-layer recompute (``model.gradient_checkpointing``) keeps a layer's input and runs its
forward again in backward, attention included. At long sequences attention is most of the work
(at 65,536 tokens about 70% of Qwen3-4B's FLOPs, `benchmarks/README.md`), so that second
forward costs nearly a quarter of the step. Here the layer is checkpointed with torch's selective
activation checkpoint (`torch.utils.checkpoint.create_selective_checkpoint_contexts`, the policy
torchtitan uses): the attention kernel's outputs (its output and softmax statistics) are saved,
every other op runs again in backward, so backward replays the norms, projections and MLP but
takes attention's result from the cache. The kernel's backward gets its recomputed q, k, v.

Memory per checkpointed layer, per token: the layer input (as with whole-layer recompute) plus
the attention output, ``query heads x (head_dim x dtype bytes + 4)`` (the fp32 statistics): at
Qwen3-4B's 32 x 128 heads in bf16 8.1 KiB, 18 GiB for 36 layers at 65,536 tokens. `unirl check`
prints the figure for a config (`unirl.core.config.recompute_plan`).

The policy knows the attention kernels by their op names (`ATTENTION_OPS`): cuDNN, flash and
memory-efficient SDPA, the CPU's flash kernel and torch's varlen custom op. An attention that
reaches none of them (SDPA's math path decomposes into matmuls) is recomputed like the rest:
correct, no saving.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

# Forward attention kernels whose outputs the checkpoint keeps, by the op's qualified name.
ATTENTION_OPS = frozenset(
    {
        "aten::_scaled_dot_product_cudnn_attention",
        "aten::_scaled_dot_product_flash_attention",
        "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_fused_attention_overrideable",
        "aten::_flash_attention_forward",
        "aten::_efficient_attention_forward",
        "aten::_cudnn_attention_forward",
        "torch_attn::_varlen_attn",
    }
)


def is_attention_op(func: Any) -> bool:
    """Whether ``func`` (an op overload) is one of `ATTENTION_OPS`, by name: the kernels a torch
    build has differ (cuDNN, flash, the CPU's), and a missing one must not fail the import."""
    return func.name().split(".")[0] in ATTENTION_OPS


def _policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Only attention's outputs are kept: anything more (the projections' outputs, the MLP's) is
    what whole-layer recompute exists to drop, and costs far less to run again."""
    return (
        CheckpointPolicy.MUST_SAVE if is_attention_op(func) else CheckpointPolicy.PREFER_RECOMPUTE
    )


def contexts() -> tuple[Any, Any]:
    """The checkpoint's ``context_fn``: each checkpointed call needs its own cache."""
    return create_selective_checkpoint_contexts(_policy)


def checkpoint_keeping_attention(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` under a non-reentrant checkpoint that keeps attention's
    outputs (module docstring); without autograd (a forward-only pass) it simply runs."""
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    return checkpoint(function, *args, use_reentrant=False, context_fn=contexts, **kwargs)


def keep_attention_in(layer: torch.nn.Module, prepare: Callable[[torch.Tensor], None]) -> None:
    """Make ``layer``'s forward run under `checkpoint_keeping_attention`. ``prepare`` gets the
    first tensor argument before each training call, outside the checkpoint: the attention's
    one-time kernel probes run there (`unirl.backends.cudnn_attention.probed`, Megatron's grouped
    heads check), since inside their kernel outputs would enter the cache and the recompute,
    which does not probe, would hand them to the layer's real attention."""
    inner = layer.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        first = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
        if first is not None and torch.is_grad_enabled():
            prepare(first)
        return checkpoint_keeping_attention(inner, *args, **kwargs)

    layer.forward = forward  # type: ignore[method-assign]
