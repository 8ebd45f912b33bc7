"""The rollout section's data-side shaping (DAPO, Yu et al. 2025, arXiv:2503.14476):
``rollout.dynamic_sampling`` (keep only the groups that teach something, drawing more prompts
until the rollout is full) and ``rollout.overlong`` (the soft overlong punishment added to the
task reward). What they do lives in `unirl.rollouts.shaping.dynamic_sampling` and `unirl.rollouts.shaping.overlong`;
`unirl check` prints both (`unirl.rollouts.shaping.settings.shaping_summary`)."""

from __future__ import annotations

from typing import Literal

import attrs

from unirl.core.config.validators import finite, non_negative, positive

# What a rollout whose draws ran out before it held batch.prompts_per_rollout kept groups does:
# train (the missing groups are filled with filtered ones whose loss mask is zero, so the plan's
# fixed sample count holds and they add nothing to the loss) or error (the run stops, naming it).
OnExhausted = Literal["train", "error"]


@attrs.frozen(kw_only=True)
class DynamicSamplingConfig:
    """DAPO's dynamic sampling: a group whose samples the criterion rejects (by default: all
    rewards equal, so every GRPO advantage is zero) is dropped, and more prompts are drawn, up to
    ``max_draws`` draws of ``batch.prompts_per_rollout`` prompts per rollout."""

    enabled: bool = False
    max_draws: int = attrs.field(default=4, validator=positive)
    on_exhausted: OnExhausted = "train"
    # A name registered in unirl.rollouts.shaping.dynamic_sampling.GROUP_FILTERS.
    criterion: str = "varied_rewards"


@attrs.frozen(kw_only=True)
class OverlongConfig:
    """DAPO's soft overlong punishment (eq. 13): 0 for responses up to rollout.max_new_tokens -
    ``buffer_tokens`` tokens, then linear down to -``penalty_factor`` at rollout.max_new_tokens
    (multi-turn episodes: against each episode's token budget, rollout.max_episode_tokens).
    ``buffer_tokens: 0`` turns it off."""

    buffer_tokens: int = attrs.field(default=0, validator=non_negative)
    penalty_factor: float = attrs.field(default=1.0, validator=[finite, positive])
