"""Right-padded ``[B, L]`` tensors -> the flat ``[T]`` inputs of the core loss library.

Every other RL framework (TRL, verl, OpenRLHF, NeMo-RL) hands its loss right-padded ``[B, L]``
tensors with a mask; unirl's core works on flat packed tokens with sequence ids. This module is the
conversion, and the argument checks a caller from outside needs: each error names the argument.

Global counts: the core divides by the counts of the WHOLE optimizer step. By default they are
this batch's own (valid tokens; sequences with at least one valid token), which is right when
one call sees the whole step. Under data parallel or gradient accumulation pass the all-reduced
counts of the step (`global_counts` below); then the returned loss is this call's share, and the
shares summed over every microbatch and rank give the step's objective.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from unirl.core.data.counts import GlobalCounts
from unirl.core.errors import LossInputError


def check_tensor(
    name: str, x: object, shape: tuple[int, ...], *, floating: bool = True, fn: str
) -> torch.Tensor:
    """``x`` as a tensor of ``shape``; `LossInputError` naming ``fn(name=...)`` otherwise."""
    if not isinstance(x, torch.Tensor):
        raise LossInputError(
            f"{fn}: {name} must be a torch.Tensor of shape {shape}, got {type(x).__name__}"
        )
    if tuple(x.shape) != shape:
        raise LossInputError(
            f"{fn}: {name} has shape {tuple(x.shape)}, expected {shape} (right-padded [B, L] "
            "like the mask; values at masked positions are ignored)"
        )
    if floating and not x.is_floating_point():
        raise LossInputError(f"{fn}: {name} must be a floating tensor, got {x.dtype}")
    return x


def check_mask(mask: object, *, fn: str) -> torch.Tensor:
    """The ``[B, L]`` mask as bool; it may be bool or hold only 0 and 1."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise LossInputError(
            f"{fn}: mask must be a [B, L] tensor (1 = a response token that counts), got {shape}"
        )
    if mask.dtype != torch.bool:
        if bool(((mask != 0) & (mask != 1)).any()):
            raise LossInputError(f"{fn}: mask must hold only 0 and 1 (or be bool)")
        mask = mask != 0
    return mask


def check_advantages(advantages: object, shape: tuple[int, int], *, fn: str) -> torch.Tensor:
    """``[B, L]`` advantages; a ``[B]`` tensor (one value per sequence, as TRL keeps them) is
    broadcast over the sequence's tokens."""
    if isinstance(advantages, torch.Tensor) and advantages.dim() == 1:
        check_tensor("advantages", advantages, shape[:1], fn=fn)
        return advantages[:, None].expand(shape)
    return check_tensor("advantages", advantages, shape, fn=fn)


def _as_count(name: str, value: object, local: int, *, fn: str) -> int:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise LossInputError(
                f"{fn}: {name} must be a number, got a tensor of shape {tuple(value.shape)}"
            )
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise LossInputError(f"{fn}: {name} must be an int, got {value!r}")
    if value < local:
        raise LossInputError(
            f"{fn}: {name}={value} is smaller than this batch's own count ({local}); pass the "
            "count of the whole optimizer step summed over every microbatch and data-parallel "
            "rank (or leave it None for this batch's own)"
        )
    return value


def step_counts(
    mask: torch.Tensor,
    global_tokens: object,
    global_sequences: object,
    norm_length: int | None,
    *,
    fn: str,
) -> GlobalCounts:
    """The step's counts: given ones are checked against this batch's, missing ones are its own."""
    tokens = int(mask.sum())
    sequences = int(mask.any(dim=1).sum())
    if global_tokens is not None:
        tokens = _as_count("global_tokens", global_tokens, tokens, fn=fn)
    if global_sequences is not None:
        sequences = _as_count("global_sequences", global_sequences, sequences, fn=fn)
    if norm_length is not None and (not isinstance(norm_length, int) or norm_length <= 0):
        raise LossInputError(f"{fn}: norm_length must be a positive int, got {norm_length!r}")
    return GlobalCounts(tokens=tokens, sequences=sequences, norm_length=norm_length)


def global_counts(mask: torch.Tensor, *, group: Any = None) -> tuple[int, int]:
    """``(tokens, sequences)`` of ``mask`` summed over every rank of ``group`` (one all-reduce):
    the ``global_tokens`` / ``global_sequences`` of a data-parallel step. ``group`` is the
    data-parallel group (``dist.group.WORLD`` when every rank is a data-parallel rank); None
    counts this batch only. Every rank of the group must call it. With gradient accumulation,
    add up the counts of the step's microbatches too.
    """
    m = check_mask(mask, fn="global_counts")
    counts = torch.stack([m.sum(), m.any(dim=1).sum()]).to(torch.int64)
    if group is not None:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    tokens, sequences = counts.tolist()
    return tokens, sequences


def flatten(
    mask: torch.Tensor, tensors: Mapping[str, torch.Tensor | None]
) -> tuple[dict[str, torch.Tensor | None], torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[B, L] -> [B*L]``: the tensors, the mask, ``seq_ids`` and per-sequence token counts.

    Masked positions are set to 0 (keeping the gradient of valid ones): padding may hold NaN (an
    engine's unscored tokens), and ``0 * NaN`` would poison a masked sum.
    """
    b, length = mask.shape
    flat_mask = mask.reshape(-1)
    out: dict[str, torch.Tensor | None] = {}
    for name, x in tensors.items():
        out[name] = (
            None
            if x is None
            else torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).reshape(-1)
        )
    seq_ids = torch.arange(b, device=mask.device).repeat_interleave(length)
    # Each sequence is whole in the batch, so its local count is its global count.
    return out, flat_mask, seq_ids, mask.sum(dim=1).to(torch.long)
