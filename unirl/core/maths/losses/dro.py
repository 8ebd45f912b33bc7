"""DRO: Direct Reward Optimisation (Richemond et al., 2024; Kimi k1.5, 2025).

An off-policy (even offline) policy gradient regularised by a quadratic penalty on the log-ratio
to the policy that sampled the data, instead of a clip::

    loss_t = -( logp_t * A_t - beta / 2 * (logp_t - old_logp_t)^2 )

so ``grad loss_t = -(A_t - beta (logp_t - old_logp_t)) grad logp_t``: on-policy it is REINFORCE,
and the further a token's log-prob moves from the sampler's, the harder it is pulled back.
``A_t`` is DRO's soft advantage, computed by the caller (the Tinker API's ``dro`` leaves it to
the client). ``beta`` is ``algorithm.dro_beta``.
"""

from __future__ import annotations

import torch

from unirl.core.data.counts import GlobalCounts
from unirl.core.maths.losses.inputs import LossInputs
from unirl.core.maths.losses.metrics import Metric
from unirl.core.maths.losses.registry import register_policy_loss
from unirl.core.maths.losses.settings import LossSettings


@register_policy_loss("dro", needs_old_logprobs=False, separable=True)
def dro_loss(
    inp: LossInputs, counts: GlobalCounts, settings: LossSettings
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """Per-token DRO loss (see the module docstring)."""
    log_ratio = inp.logprobs - inp.resolved_old_logprobs()
    loss_t = -(inp.logprobs * inp.advantages - 0.5 * settings.dro_beta * log_ratio.square())
    return loss_t, {}
