"""CISPO: Clipped IS-weight Policy Optimization (MiniMax-M1 report, 2025).

PPO drops the gradient of every token whose ratio leaves the clip range — often the rare
"fork" tokens that matter most for reasoning. CISPO clips the importance-sampling WEIGHT
instead and keeps every token's gradient::

    r_t = exp(logp_t - old_logp_t)
    loss_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) * A_t * logp_t

so ``grad loss_t = -clip(r_t) A_t grad logp_t``. Both bounds come from the settings; the paper
imposes no lower bound (its epsilon_low is "a large value") and tunes only the upper one: set
``clip_low: 1.0`` (lower bound 0) to match it. ``pg_clipfrac`` is the fraction of valid tokens
whose weight was clipped.
"""

from __future__ import annotations

import torch

from unirl.core.data.counts import GlobalCounts
from unirl.core.maths.losses.aggregation import token_mean_metric
from unirl.core.maths.losses.inputs import LossInputs
from unirl.core.maths.losses.metrics import Metric
from unirl.core.maths.losses.ratio import ratio_from_log
from unirl.core.maths.losses.registry import register_policy_loss
from unirl.core.maths.losses.settings import LossSettings


@register_policy_loss("cispo", needs_old_logprobs=False, separable=True)
def cispo_loss(
    inp: LossInputs, counts: GlobalCounts, settings: LossSettings
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """Per-token CISPO loss (see the module docstring)."""
    ratio = ratio_from_log(inp.logprobs.detach() - inp.resolved_old_logprobs())
    low, high = 1.0 - settings.clip_low, 1.0 + settings.clip_high
    weight = ratio.clamp(low, high)
    loss_t = -weight * inp.advantages * inp.logprobs
    clipped = (ratio < low) | (ratio > high)
    return loss_t, {"pg_clipfrac": token_mean_metric(clipped, inp.mask)}
