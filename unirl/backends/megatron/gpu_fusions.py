"""Triton kernels in place of two unfused megatron-core functions, on CUDA without Transformer
Engine: packed RoPE (`unirl.backends.megatron.fused_rope`) and the SwiGLU backward
(`unirl.backends.megatron.fused_swiglu`).

Each `FusionPatch` names the module attribute replaced (where megatron-core's callers look it
up at call time) and the lines that call it, read in `CHECKED_VERSIONS`. A replacement has the
original's signature and result, and hands any argument it does not cover back to the original
(kept in the replacement module's ``ORIGINAL``). `install()` applies them only where CUDA and
Triton are present, megatron-core is a checked version and TE is absent (with TE, megatron runs
TE's fused RoPE when ``apply_rope_fusion`` is set); otherwise it logs why and changes nothing,
so the CPU tier keeps megatron's own code.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

import attrs
import torch

from unirl.backends.megatron import fused_rope, fused_swiglu

logger = logging.getLogger(__name__)

# The megatron-core versions whose source the lines below were read from.
CHECKED_VERSIONS = ("0.16.1",)


@attrs.frozen(kw_only=True)
class FusionPatch:
    """``module.name`` replaced by ``replacement``; ``originals`` is where it keeps megatron's."""

    module: str
    name: str
    replacement: Callable[..., Any]
    originals: dict[str, Callable[..., Any]]
    lines: tuple[str, ...]  # "file:line" under megatron/core that call the name


PATCHES: tuple[FusionPatch, ...] = (
    FusionPatch(
        module="megatron.core.models.common.embeddings.rope_utils",
        name="_apply_rotary_pos_emb_thd",
        replacement=fused_rope.apply_rotary_pos_emb_thd,
        originals=fused_rope.ORIGINAL,
        lines=(
            # apply_rotary_pos_emb, unfused branch with cu_seqlens (SelfAttention's q and k)
            "models/common/embeddings/rope_utils.py:303",
        ),
    ),
    FusionPatch(
        module="megatron.core.fusions.fused_bias_swiglu",
        name="swiglu_back",
        replacement=fused_swiglu.swiglu_back,
        originals=fused_swiglu.ORIGINAL,
        lines=(
            "fusions/fused_bias_swiglu.py:187",  # SwiGLUFunction.backward
            "fusions/fused_bias_swiglu.py:86",  # bias_swiglu_back (compiled; graph break)
            "fusions/fused_bias_swiglu.py:93",  # weighted_swiglu_back (compiled; graph break)
        ),
    ),
)

_state: dict[str, bool | None] = {"installed": None}


def refusal() -> str | None:
    """None when `install` applies the patches here, else why not."""
    from megatron.core import package_info

    if not torch.cuda.is_available():
        return "no CUDA device"
    if fused_rope.triton is None or fused_swiglu.triton is None:
        return "Triton is not installed"
    if package_info.__version__ not in CHECKED_VERSIONS:
        return (
            f"megatron-core {package_info.__version__}; unirl/backends/megatron/gpu_fusions.py "
            f"was checked against {', '.join(CHECKED_VERSIONS)}"
        )
    from unirl.backends.megatron.model import te_available

    if te_available():
        return "Transformer Engine is installed (megatron uses its fused kernels)"
    return None


def install() -> bool:
    """Apply `PATCHES` (idempotent); True when applied. Call before running a model."""
    if _state["installed"] is not None:
        return bool(_state["installed"])
    why = refusal()
    if why is not None:
        logger.info("megatron Triton fusions off: %s", why)
        _state["installed"] = False
        return False
    for patch in PATCHES:
        module = importlib.import_module(patch.module)
        patch.originals.setdefault(patch.name, getattr(module, patch.name))
        setattr(module, patch.name, patch.replacement)
    logger.info(
        "megatron Triton fusions on: %s (unirl.backends.megatron.gpu_fusions)",
        ", ".join(f"{p.module}.{p.name}" for p in PATCHES),
    )
    _state["installed"] = True
    return True
