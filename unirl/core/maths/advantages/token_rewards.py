"""A sample's reward as its estimator reads it. A sample may say where in its response parts of
its reward were earned (``token_rewards [L]``, e.g. a multi-turn episode's per-turn rewards on
each turn's last token); its ``reward`` is always the total. A token-level estimator
(``reads_token_rewards``: reinforce_pp, gae) gets the token rewards and the rest of the reward,
``reward - sum(token_rewards)``, as the outcome at the last valid token; a sequence-level one
(grpo, rloo, ...) gets the total alone, so both see the same return."""

from __future__ import annotations

import torch

from unirl.core.maths.advantages.registry import get_advantage_estimator


def rewards_for_estimator(
    rewards: torch.Tensor, token_rewards: torch.Tensor | None, estimator: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(outcome rewards [B], token rewards [B, L] or None)`` for ``estimator``, from the
    batch's total ``rewards [B]`` and padded ``token_rewards [B, L]`` (zeros past each
    response)."""
    if token_rewards is None or not get_advantage_estimator(estimator).reads_token_rewards:
        return rewards, None
    # in float64: the outcome left over is exactly 0 when the token rewards are the whole reward
    rest = rewards.to(torch.float64) - token_rewards.to(torch.float64).sum(1)
    return rest.to(rewards.dtype), token_rewards
