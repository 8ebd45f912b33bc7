"""PPO clipped surrogate, with separate low / high clip bounds and optional dual clip.

Per token, with ``r_t = exp(logp_t - old_logp_t)`` and advantage ``A_t``::

    loss_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high))        (PPO, 2017)
    if A_t < 0 and dual_clip = c:  loss_t = min(loss_t, -c A_t)                (Ye et al. 2020)

- PPO: Schulman et al., "Proximal Policy Optimization Algorithms", 2017.
- GRPO (Shao et al., DeepSeekMath, 2024) is this loss fed group-normalised advantages
  (``advantage_estimator: grpo``), usually with ``seq-mean-token-mean`` aggregation.
- DAPO's clip-higher (Yu et al., 2025) is ``clip_high > clip_low`` (e.g. 0.2 / 0.28), with
  ``token-mean`` aggregation.
- Dual clip (Ye et al., "Mastering Complex Control in MOBA Games with Deep RL", 2020) caps the
  loss of a negative-advantage token whose ratio has exploded at ``c |A|``, so one stale token
  cannot dominate the step.
"""

from __future__ import annotations

import torch

from unirl.core.data.counts import GlobalCounts
from unirl.core.maths.losses.aggregation import token_mean_metric
from unirl.core.maths.losses.inputs import LossInputs
from unirl.core.maths.losses.metrics import Metric
from unirl.core.maths.losses.ratio import clipped_surrogate, ratio_from_log
from unirl.core.maths.losses.registry import register_policy_loss
from unirl.core.maths.losses.settings import LossSettings


@register_policy_loss("ppo_clip", needs_old_logprobs=False, separable=True)
def ppo_clip_loss(
    inp: LossInputs, counts: GlobalCounts, settings: LossSettings
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """Per-token PPO-clip loss (see the module docstring)."""
    ratio = ratio_from_log(inp.logprobs - inp.resolved_old_logprobs())
    adv = inp.advantages
    loss_t, clipped = clipped_surrogate(ratio, adv, settings.clip_low, settings.clip_high)
    metrics = {"pg_clipfrac": token_mean_metric(clipped, inp.mask)}
    if settings.dual_clip is not None:
        bound = -settings.dual_clip * adv  # c |A| for A < 0
        negative = adv < 0
        metrics["pg_clipfrac_lower"] = token_mean_metric(negative & (loss_t > bound), inp.mask)
        loss_t = torch.where(negative, torch.minimum(loss_t, bound), loss_t)
    return loss_t, metrics
