"""Truncation masks (``algorithm.mask_truncated``; DAPO's overlong filtering, Yu et al. 2025,
arXiv:2503.14476 section 3.4; TRL's ``mask_truncated_completions``): a response cut at
``rollout.max_new_tokens``, or an episode cut at its turn or token limit, carries the reward of an
unfinished answer, so it contributes no policy-gradient token.

It is done by zeroing the sample's loss mask before the step plans its microbatches: every
consumer of the mask follows (the policy loss, entropy and KL terms, the critic's value loss),
and so do the step's global token and sequence counts (`unirl.core.data.plan`: a sequence counts
only with a valid token), so each backend's loss stays the exact mean over the tokens left.
Its reward still counts where the estimator needs it: GRPO's group mean and standard deviation
(and RLOO's leave-one-out baseline) include it, since it is a draw from the same prompt's
response distribution; dropping it would bias the baseline toward short answers. A sample says
whether it was cut in ``metadata["finished"]`` (generating sources write it; a rollout file must).
"""

from __future__ import annotations

import attrs
import torch

from unirl.core.data.rollout import RolloutBatch
from unirl.core.errors import RolloutDataError


def is_truncated(metadata: dict, index: int) -> bool:
    """Whether the sample was cut (``finished`` false); a sample that does not say is refused."""
    if "finished" not in metadata:
        raise RolloutDataError(
            f"sample {index}: algorithm.mask_truncated needs metadata['finished'] (whether a stop "
            "ended the response, or the length limit cut it) and this sample has none; add it to "
            "the rollout file or set algorithm.mask_truncated: false"
        )
    return not metadata["finished"]


def mask_truncated(batch: RolloutBatch) -> tuple[RolloutBatch, int]:
    """``batch`` with the loss mask of every cut sample zeroed, and how many were cut."""
    samples, cut = [], 0
    for i, s in enumerate(batch.samples):
        if is_truncated(s.metadata, i):
            cut += 1
            s = attrs.evolve(s, loss_mask=torch.zeros_like(s.loss_mask))
        samples.append(s)
    return attrs.evolve(batch, samples=tuple(samples)), cut
