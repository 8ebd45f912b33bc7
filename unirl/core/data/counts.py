"""Global normalisers of one optimizer step.

A loss contribution computed on one microbatch of one rank must be divided by quantities of the
*whole* optimizer step (all microbatches, all DP x CP ranks), or the sum over microbatches is not
the loss of the batch. The microbatch plan knows them before any forward runs (every rank plans
from the same global batch), so no collective is needed to get them.
"""

from __future__ import annotations

import attrs

from unirl.core.errors import LossInputError


@attrs.frozen(kw_only=True)
class GlobalCounts:
    """Valid (loss-mask) tokens and sequences of one optimizer step, over all ranks."""

    tokens: int
    sequences: int
    # Dr.GRPO's constant for seq-mean-token-sum-norm: the generation budget, not a batch value.
    norm_length: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.tokens < 0 or self.sequences < 0:
            raise LossInputError(f"GlobalCounts must be non-negative, got {self}")

    def require_tokens(self) -> int:
        return max(self.tokens, 1)  # an all-masked step: zero loss, not NaN

    def require_sequences(self) -> int:
        return max(self.sequences, 1)

    def require_norm_length(self) -> int:
        if self.norm_length is None:
            raise LossInputError(
                "loss_aggregation 'seq-mean-token-sum-norm' needs GlobalCounts.norm_length "
                "(set algorithm.norm_length, usually the rollout's max new tokens)"
            )
        return self.norm_length
