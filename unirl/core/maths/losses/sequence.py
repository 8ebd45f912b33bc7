"""Per-sequence sums of per-token values, correct under context parallel.

Under CP a sequence's tokens are spread over the CP ranks, so a sequence-level quantity (GSPO's
sequence ratio, a sequence mask) is a local sum followed by a sum over the CP group. The sum is
autograd-aware (`unirl.core.data.context_parallel.cp_all_reduce`): its backward all-reduces the
gradient, so every rank's local tokens get the gradient of every rank's loss terms. A value built
from these sums is replicated on the CP ranks; use it only inside per-token terms summed over
local tokens, or it is counted once per CP rank.
"""

from __future__ import annotations

from typing import Any

import torch

from unirl.core.data.context_parallel import cp_all_reduce


def sequence_sum(
    values_t: torch.Tensor, seq_ids: torch.Tensor, num_seqs: int, cp_group: Any = None
) -> torch.Tensor:
    """``out[s] = sum of values_t[t] over the tokens t of sequence s`` on all CP ranks, ``[S]``.

    Mask ``values_t`` first if padding must not count. ``cp_group=None``: sequences are whole on
    this rank (no communication).
    """
    local = values_t.new_zeros(num_seqs).index_add(0, seq_ids, values_t)
    return cp_all_reduce(local, cp_group)


def sequence_mean(
    values_t: torch.Tensor,
    mask_t: torch.Tensor,
    seq_ids: torch.Tensor,
    seq_token_counts: torch.Tensor,
    cp_group: Any = None,
) -> torch.Tensor:
    """Mean of ``values_t`` over each sequence's valid tokens, ``[S]``; 0 for a fully masked one.

    Divides by the GLOBAL valid-token count of each sequence (``seq_token_counts``), so every CP
    rank gets the mean over the whole sequence.
    """
    sums = sequence_sum(values_t * mask_t, seq_ids, seq_token_counts.numel(), cp_group)
    return sums / seq_token_counts.to(sums.dtype).clamp(min=1.0)
