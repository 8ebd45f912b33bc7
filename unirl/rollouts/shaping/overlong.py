"""DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13), added to the task
reward of a response of ``length`` tokens under a budget of ``L_max`` = ``rollout.max_new_tokens``
with a buffer of ``L_cache`` = ``rollout.overlong.buffer_tokens``:

    R(y) = 0                                 |y| <= L_max - L_cache
         = ((L_max - L_cache) - |y|) / L_cache   L_max - L_cache < |y| <= L_max
         = -1                                L_max < |y|

times ``rollout.overlong.penalty_factor``. A response cut at the budget has ``|y| = L_max`` and
gets the full -factor: the answer it carries is unfinished. Applied where the rollout's rewards are
scored (`GeneratingSource.build_batch`), logged as ``reward/overlong_penalty`` beside the task
reward (``reward/task_mean``). A multi-turn episode is measured against its own token budget
(`unirl.rollouts.environments.episode_batch`).
"""

from __future__ import annotations

from unirl.core.config.sections.rollout_shaping import OverlongConfig


def overlong_penalty(length: int, *, max_new_tokens: int, config: OverlongConfig) -> float:
    """The (non-positive) reward added to a response of ``length`` tokens; 0 when off."""
    buffer = config.buffer_tokens
    if buffer == 0:
        return 0.0
    start = max_new_tokens - buffer
    if length <= start:
        return 0.0
    if length > max_new_tokens:
        return -config.penalty_factor
    return (start - length) / buffer * config.penalty_factor
