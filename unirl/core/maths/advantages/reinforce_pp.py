"""REINFORCE++ and REINFORCE++-baseline (Hu 2025, "REINFORCE++: A Simple and Efficient Approach
for Aligning Large Language Models").

REINFORCE++: no critic and no per-prompt baseline. Each token's reward is the outcome reward at
the last valid token minus the KL-in-reward penalty ``coef * KL_t(old || ref)``; the advantage is
the discounted return-to-go ``G_t = r_t + gamma * G_{t+1}``, whitened over the *whole batch*
(global mean and std of all valid tokens on all ranks).

REINFORCE++-baseline: first subtract the group mean of the outcome rewards
(``r_i - mean_g(r)``), then the same KL shaping, return-to-go and batch whitening.

The functions return the un-whitened return-to-go as advantages; they are registered with
``whitens_over_batch=True`` and `compute_advantages` whitens over every rank of its process
group. The return-to-go runs over *valid* tokens only: a masked token inside a response (a
tool's output in a multi-turn rollout) neither gets a return nor breaks the chain.
"""

from __future__ import annotations

import torch

from unirl.core.maths.advantages.groups import float_dtype, group_index, group_mean
from unirl.core.maths.advantages.inputs import AdvantageInputs
from unirl.core.maths.advantages.output import AdvantageOutput
from unirl.core.maths.advantages.registry import register_advantage_estimator
from unirl.core.maths.advantages.settings import AdvantageSettings
from unirl.core.maths.advantages.shaping import token_level_rewards


def discounted_returns(rewards_t: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma * G_next`` where ``next`` is the next *valid* token; 0 off the mask."""
    mask = mask.bool()
    if gamma == 1.0:
        # Undiscounted: a reverse cumulative sum, one kernel instead of a loop over L.
        summed = torch.where(mask, rewards_t, 0.0).flip(1).cumsum(1).flip(1)
        return torch.where(mask, summed, 0.0)
    returns = torch.zeros_like(rewards_t)
    running = torch.zeros_like(rewards_t[:, 0])
    for t in reversed(range(rewards_t.shape[1])):
        g = rewards_t[:, t] + gamma * running
        running = torch.where(mask[:, t], g, running)
        returns[:, t] = torch.where(mask[:, t], g, 0.0)
    return returns


@register_advantage_estimator("reinforce_pp", reads_token_rewards=True, whitens_over_batch=True)
def reinforce_pp(inp: AdvantageInputs, settings: AdvantageSettings) -> AdvantageOutput:
    returns = discounted_returns(token_level_rewards(inp, settings), inp.mask, settings.gamma)
    return AdvantageOutput(advantages=returns, returns=returns)


@register_advantage_estimator("reinforce_pp_baseline", needs_groups=True, whitens_over_batch=True)
def reinforce_pp_baseline(inp: AdvantageInputs, settings: AdvantageSettings) -> AdvantageOutput:
    rewards = inp.rewards.to(float_dtype(inp.rewards))
    inverse, counts = group_index(inp.group_ids)
    centered = rewards - group_mean(rewards, inverse, counts)
    rewards_t = token_level_rewards(inp, settings, outcome=centered)
    returns = discounted_returns(rewards_t, inp.mask, settings.gamma)
    return AdvantageOutput(advantages=returns, returns=returns)
