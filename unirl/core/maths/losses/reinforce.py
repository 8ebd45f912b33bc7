"""REINFORCE (Williams, 1992): the plain policy gradient, no ratio and no clipping.

    loss_t = -A_t * logp_t

Strictly on-policy: it reads no pre-step log-probs, so it never needs the old-log-prob forward.
With REINFORCE++ or RLOO advantages this is the whole policy loss of those methods when each
rollout is used for one optimizer step.
"""

from __future__ import annotations

import torch

from unirl.core.data.counts import GlobalCounts
from unirl.core.maths.losses.inputs import LossInputs
from unirl.core.maths.losses.metrics import Metric
from unirl.core.maths.losses.registry import register_policy_loss
from unirl.core.maths.losses.settings import LossSettings


@register_policy_loss("reinforce", needs_old_logprobs=False, separable=True)
def reinforce_loss(
    inp: LossInputs, counts: GlobalCounts, settings: LossSettings
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """Per-token REINFORCE loss ``-A_t logp_t``."""
    return -inp.advantages * inp.logprobs, {}
