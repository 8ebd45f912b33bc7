"""Whether the training forward's LM head runs fused (``model.fused_head``), decided from shapes.

The plain head holds the ``[tokens, vocab]`` logits of a microbatch and, in backward, their
gradient of the same size: at 65,536 tokens x 151,936 in bf16 that is 2 x 18.5 GiB on one rank,
more than a 4B model's activations under recompute. The fused head never holds them (the loss
inside the head: three head matmuls over token chunks, `unirl.core.maths.head_loss`), but below a
few GiB the plain head is the faster one (benchmarks/README.md, "fused_head"). So
``model.fused_head: auto`` (the default) compares the plain head's bytes per rank for the largest
microbatch the plan allows with ``model.fused_head_logits_gib``:

    tokens  = batch.max_tokens_per_microbatch, or micro_batch_size x model.max_seq_len,
              divided by parallel.cp (context parallel splits every sequence) and rounded up
    vocab   = model vocabulary / parallel.tp, rounded up (the vocabulary-parallel output layer)
    bytes   = 2 x tokens x vocab x bytes per element of model.dtype   (logits + their gradient)

and fuses when ``bytes`` exceeds the budget. ``true`` / ``false`` force it. The choice is made
once from the config, so ``unirl check`` prints the same one the run takes.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import attrs

from unirl.core.config.model_shape import hf_config_fields

if TYPE_CHECKING:
    from unirl.core.config.run_config import UnirlConfig

GIB = 1 << 30
DTYPE_BYTES = {"fp32": 4, "bf16": 2}


@attrs.frozen
class FusedHeadChoice:
    """Whether the head runs fused, and why (`unirl check`'s "LM head and loss")."""

    fused: bool
    reason: str
    logits_bytes: int | None  # the plain head's logits + gradient per rank; None: not known


def plain_head_bytes(tokens: int, vocab: int, tp: int, dtype: str) -> int:
    """Bytes of the plain head's logits and their gradient on one rank (module docstring)."""
    return 2 * tokens * math.ceil(vocab / tp) * DTYPE_BYTES[dtype]


def size_text(size: int) -> str:
    """``size`` bytes as GiB, or MiB below a hundredth of one (the plans' reports)."""
    return f"{size / GIB:.2f} GiB" if size >= GIB // 100 else f"{size / 2**20:.3f} MiB"


def microbatch_tokens(cfg: UnirlConfig) -> int:
    """The most tokens one rank's microbatch can hold under the plan (module docstring)."""
    b = cfg.batch
    if b.max_tokens_per_microbatch is not None:
        tokens = b.max_tokens_per_microbatch
    else:
        tokens = (b.micro_batch_size or 1) * cfg.model.max_seq_len
    return math.ceil(tokens / cfg.parallel.cp)


def choose_fused_head(cfg: UnirlConfig) -> FusedHeadChoice:
    """``model.fused_head`` resolved: forced by true / false, or by the budget under auto."""
    m = cfg.model
    if m.fused_head is True:
        return FusedHeadChoice(True, "model.fused_head: true", None)
    if m.fused_head is False:
        return FusedHeadChoice(False, "model.fused_head: false", None)
    vocab = (hf_config_fields(m) or {}).get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool):
        return FusedHeadChoice(
            False, "model.fused_head: auto, the vocabulary size is unknown: plain head", None
        )
    tokens = microbatch_tokens(cfg)
    size = plain_head_bytes(tokens, vocab, cfg.parallel.tp, m.dtype)
    shape = (
        f"{tokens:,} tokens x {math.ceil(vocab / cfg.parallel.tp):,} vocabulary per rank in "
        f"{m.dtype}: logits + gradient {size_text(size)}"
    )
    fused = size > m.fused_head_logits_gib * GIB
    verdict = "above" if fused else "within"
    head = "fused head (no logits)" if fused else "plain head (logits)"
    return FusedHeadChoice(
        fused,
        f"model.fused_head: auto, {shape}, {verdict} model.fused_head_logits_gib="
        f"{m.fused_head_logits_gib:g}: {head}",
        size,
    )
