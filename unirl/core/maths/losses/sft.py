"""Supervised fine-tuning: negative log-likelihood of the masked tokens.

    loss_t = -logp_t

Aggregated like every other loss (``token-mean`` is the usual cross-entropy). Advantages are
ignored; pass zeros. Reads no pre-step log-probs.
"""

from __future__ import annotations

import torch

from unirl.core.data.counts import GlobalCounts
from unirl.core.maths.losses.inputs import LossInputs
from unirl.core.maths.losses.metrics import Metric
from unirl.core.maths.losses.registry import register_policy_loss
from unirl.core.maths.losses.settings import LossSettings


@register_policy_loss("sft", needs_old_logprobs=False, separable=True)
def sft_loss(
    inp: LossInputs, counts: GlobalCounts, settings: LossSettings
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """Per-token negative log-likelihood ``-logp_t``."""
    return -inp.logprobs, {}
