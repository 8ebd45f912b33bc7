"""Packed microbatches as right-padded ``[rows, L]`` batches, and the logits of their real tokens.

The schedules feed this form when ``megatron.attention`` is ``padded`` or ``unfused`` (the default,
``packed``, feeds the token stream as it is: `unirl.backends.megatron.packed`). A packed `TrainMicrobatch` with sequences of lengths ``l_0 .. l_k`` becomes one row per
sequence, padded at the end to a common length ``L``::

    tokens[r, :l_r] = the sequence's tokens     tokens[r, l_r:] = pad (0)
    position_ids[r] = 0 .. L-1                  (RoPE positions restart per sequence)

Causal attention never lets a real token see the padding after it, so the real positions' logits
are exactly the per-sequence ones. `valid_logits` takes ``logits[r, :l_r]`` for every row in
packed order: a row gather of ``[T, V_local]`` from the local vocabulary shard (no vocabulary
communication), which is the logit-position alignment of the microbatch's targets.

Pipeline parallel sends activations of one fixed shape per schedule call (``seq_length`` x
``micro_batch_size``), so every microbatch of a call is padded to the same ``(rows, L)``: the
maxima over the call's microbatches (`padded_shape`). An empty microbatch (no tokens) becomes one
row of padding whose logits are never read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from unirl.core.data.microbatch import TrainMicrobatch

PAD_ID = 0  # any valid id: padded positions are never attended to from real ones nor read


@attrs.frozen(kw_only=True)
class PaddedBatch:
    """One microbatch as the model reads it."""

    tokens: torch.Tensor  # [rows, L] int64
    position_ids: torch.Tensor  # [rows, L] int64
    flat_index: torch.Tensor  # [T] int64: row * L + column of each real token, packed order

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def schedule_tokens(self) -> int:
        """The activation length megatron's p2p sends per row (its ``seq_length``)."""
        return self.seq_len

    def model_kwargs(self) -> dict[str, Any]:
        # causal: no mask; right padding is never attended to from real tokens
        return {
            "input_ids": self.tokens,
            "position_ids": self.position_ids,
            "attention_mask": None,
        }

    def real_logits(self, logits_blv: torch.Tensor) -> torch.Tensor:
        return valid_logits(logits_blv, self)

    def to(self, device: torch.device) -> PaddedBatch:
        return PaddedBatch(
            tokens=self.tokens.to(device, non_blocking=True),
            position_ids=self.position_ids.to(device, non_blocking=True),
            flat_index=self.flat_index.to(device, non_blocking=True),
        )


def padded_shape(microbatches: Sequence[TrainMicrobatch]) -> tuple[int, int]:
    """``(rows, L)`` that holds every microbatch: the most sequences and the longest sequence
    (at least one row of one position, for empty microbatches)."""
    rows, length = 1, 1
    for mb in microbatches:
        lengths = mb.sequence_lengths
        rows = max(rows, len(lengths))
        length = max(length, max(lengths, default=0))
    return rows, length


def empty_padded(rows: int, seq_len: int) -> PaddedBatch:
    """A batch of padding only (no real token): fills the schedule where a call needs more
    microbatches than it has (VPP)."""
    return PaddedBatch(
        tokens=torch.full((rows, seq_len), PAD_ID, dtype=torch.long),
        position_ids=torch.arange(seq_len).expand(rows, seq_len).contiguous(),
        flat_index=torch.zeros(0, dtype=torch.long),
    )


def to_padded(mb: TrainMicrobatch, rows: int, seq_len: int) -> PaddedBatch:
    """`mb` right-padded to ``[rows, seq_len]`` (see the module docstring)."""
    lengths = mb.sequence_lengths
    if len(lengths) > rows or max(lengths, default=0) > seq_len:
        raise ValueError(
            f"microbatch with sequence lengths {lengths} does not fit a padded batch of "
            f"{rows} rows x {seq_len} positions; compute the shape with padded_shape"
        )
    tokens = torch.full((rows, seq_len), PAD_ID, dtype=torch.long)
    starts = mb.cu_seqlens[:-1].tolist()
    index = []
    for r, (start, n) in enumerate(zip(starts, lengths)):
        tokens[r, :n] = mb.tokens[start : start + n].to(torch.long)
        index.append(torch.arange(r * seq_len, r * seq_len + n, dtype=torch.long))
    flat_index = torch.cat(index) if index else torch.zeros(0, dtype=torch.long)
    position_ids = torch.arange(seq_len, dtype=torch.long).expand(rows, seq_len).contiguous()
    return PaddedBatch(tokens=tokens, position_ids=position_ids, flat_index=flat_index)


def valid_logits(logits_blv: torch.Tensor, batch: PaddedBatch) -> torch.Tensor:
    """The logits of the real positions, in packed order: ``[T, V_local]`` from the model's
    batch-first ``[rows, L, V_local]`` (a row gather; the vocabulary shard stays local)."""
    vocab = logits_blv.shape[-1]
    return logits_blv.reshape(-1, vocab).index_select(0, batch.flat_index)
