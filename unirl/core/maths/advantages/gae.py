"""GAE: generalized advantage estimation from a critic (Schulman et al. 2016, "High-Dimensional
Continuous Control Using Generalized Advantage Estimation"), the advantage of PPO with a critic.

Over the valid tokens of a response, with ``V_t`` the critic's value before token t and
``next`` the next valid token (the response's end is terminal: ``V = 0`` after it)::

    delta_t = r_t + gamma * V_next - V_t
    A_t     = delta_t + gamma * lam * A_next
    returns = A_t + V_t                      (the critic's regression target)

``r_t`` is the outcome reward at the last valid token plus any ``token_rewards``, minus
``kl_in_reward_coef * KL_t(old || ref)``. Masked tokens inside a response (tool output) are
skipped: they get no advantage and do not discount. PPO usually whitens these advantages over
the batch (verl does): set ``AdvantageSettings.whiten=True`` for that.
"""

from __future__ import annotations

import torch

from unirl.core.maths.advantages.groups import float_dtype
from unirl.core.maths.advantages.inputs import AdvantageInputs
from unirl.core.maths.advantages.output import AdvantageOutput
from unirl.core.maths.advantages.registry import register_advantage_estimator
from unirl.core.maths.advantages.settings import AdvantageSettings
from unirl.core.maths.advantages.shaping import token_level_rewards


def gae_recursion(
    rewards_t: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)``, both ``[B, L]`` and zero off the mask."""
    mask = mask.bool()
    advantages = torch.zeros_like(rewards_t)
    next_value = torch.zeros_like(rewards_t[:, 0])
    next_adv = torch.zeros_like(rewards_t[:, 0])
    for t in reversed(range(rewards_t.shape[1])):
        valid = mask[:, t]
        value = values[:, t]
        delta = rewards_t[:, t] + gamma * next_value - value
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = torch.where(valid, adv, 0.0)
        next_value = torch.where(valid, value, next_value)
        next_adv = torch.where(valid, adv, next_adv)
    returns = torch.where(mask, advantages + values, 0.0)
    return advantages, returns


# needs_old_logprobs: PPO with a critic takes several clipped steps per rollout, so its ratio
# needs the pre-step log-probs.
@register_advantage_estimator(
    "gae", needs_values=True, needs_old_logprobs=True, reads_token_rewards=True
)
def gae(inp: AdvantageInputs, settings: AdvantageSettings) -> AdvantageOutput:
    inp.require(("values",), by="estimator 'gae'")
    rewards_t = token_level_rewards(inp, settings)
    dtype = torch.promote_types(rewards_t.dtype, float_dtype(inp.values))
    rewards_t, values = rewards_t.to(dtype), inp.values.to(dtype)
    advantages, returns = gae_recursion(rewards_t, values, inp.mask, settings.gamma, settings.lam)
    return AdvantageOutput(advantages=advantages, returns=returns)
