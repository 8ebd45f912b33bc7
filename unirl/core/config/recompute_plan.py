"""Activation recompute of the policy (``model.gradient_checkpointing``, ``model.recompute_attention``):
what `unirl check` reports of it (its rules: `unirl.core.config.recompute_rules`).

With ``model.recompute_attention: false`` the checkpointed layers keep their attention's output
and recompute only the rest (`unirl.backends.kept_attention`); that costs, per rank,

    kept = checkpointed layers x tokens x ceil(query heads / parallel.tp)
           x (head_dim x bytes per element of model.dtype + 4)

``tokens`` being the largest microbatch per rank (`head_memory.microbatch_tokens`, divided by
parallel.cp), the layers those of one pipeline stage (all its chunks), or the first
``megatron.recompute_layers`` of each chunk; per microbatch: under pipeline parallel a stage
holds up to ``parallel.pp`` microbatches in flight (1F1B), and the report gives that bound. It
saves the attention forward that whole-layer recompute runs a second time: at 65,536 tokens
about 70% of a Qwen3-4B forward. The choice is
the user's: what else a step holds (the layers not recomputed, the head, the optimizer's
buffers) is not counted here, so the plan does not decide it; it prints the figure.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from unirl.core.config.head_memory import DTYPE_BYTES, microbatch_tokens, size_text
from unirl.core.config.model_shape import head_dim, hf_config_fields

if TYPE_CHECKING:
    from unirl.core.config.run_config import UnirlConfig


def kept_attention_bytes(cfg: UnirlConfig, hf: dict[str, Any]) -> tuple[int, int, int] | None:
    """(bytes, checkpointed layers, tokens) per rank of the kept attention outputs (module
    docstring); None when the config lacks the shape."""
    try:
        layers, heads = int(hf["num_hidden_layers"]), int(hf["num_attention_heads"])
        width = head_dim(hf)
    except (KeyError, TypeError, ValueError):
        return None
    p = cfg.parallel
    per_stage = math.ceil(layers / p.pp)
    narrowed = getattr(cfg.backend_options, "recompute_layers", None)  # megatron's block
    if narrowed is not None:
        per_stage = min(per_stage, narrowed * (p.vpp or 1))
    tokens = microbatch_tokens(cfg)
    size = per_stage * tokens * math.ceil(heads / p.tp) * (width * DTYPE_BYTES[cfg.model.dtype] + 4)
    return size, per_stage, tokens


def recompute_note(cfg: UnirlConfig) -> str:
    """What the policy's layers recompute in backward, for `unirl check`."""
    m = cfg.model
    options = cfg.backend_options
    if not m.gradient_checkpointing:
        modules = list(getattr(options, "recompute_modules", ()))
        if modules:
            return (
                f"megatron.recompute_modules={modules}: megatron's selective recompute runs "
                "those parts of every layer again in backward, the rest keep their activations"
            )
        return "model.gradient_checkpointing: false: every layer keeps its activations"
    narrowed = getattr(options, "recompute_layers", None)
    which = (
        "every layer"
        if narrowed is None
        else f"the first {narrowed} layers of each chunk (megatron.recompute_layers; the others "
        "keep their activations)"
    )
    if m.recompute_attention:
        return (
            f"model.gradient_checkpointing: true: {which} keeps its input and runs its whole "
            "forward again in backward, attention included (model.recompute_attention: false "
            "keeps attention's output instead)"
        )
    kept = kept_attention_bytes(cfg, hf_config_fields(m) or {})
    pp = cfg.parallel.pp
    size = (
        "its size unknown (the model's config lacks the shape)"
        if kept is None
        else f"{size_text(kept[0])} per rank and microbatch ({kept[1]} layers x {kept[2]:,} tokens)"
        + (
            f", up to {size_text(pp * kept[0])} with parallel.pp={pp} microbatches in flight"
            if pp > 1
            else ""
        )
    )
    return (
        f"model.gradient_checkpointing: true, model.recompute_attention: false: {which} keeps "
        "its input and its attention's output and statistics, and runs the rest of its forward "
        f"again in backward; the kept attention outputs: {size}"
    )
