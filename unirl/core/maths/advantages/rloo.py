"""RLOO: REINFORCE with a leave-one-out baseline.

Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from
Human Feedback in LLMs". With k samples of one prompt, each sample's baseline is the mean reward
of the *other* k - 1 samples, which keeps the baseline independent of the sample's own action::

    A_i = r_i - (sum_g(r) - r_i) / (k - 1)  =  k / (k - 1) * (r_i - mean_g(r))

broadcast over the response tokens. Needs k >= 2 in every group.
"""

from __future__ import annotations

from unirl.core.errors import LossInputError
from unirl.core.maths.advantages.groups import (
    broadcast_to_tokens,
    group_index,
    group_sum,
    sequence_rewards,
)
from unirl.core.maths.advantages.inputs import AdvantageInputs
from unirl.core.maths.advantages.output import AdvantageOutput
from unirl.core.maths.advantages.registry import register_advantage_estimator
from unirl.core.maths.advantages.settings import AdvantageSettings


@register_advantage_estimator("rloo", needs_groups=True)
def rloo(inp: AdvantageInputs, settings: AdvantageSettings) -> AdvantageOutput:
    rewards = sequence_rewards(inp, settings, "rloo")
    inverse, counts = group_index(inp.group_ids)
    if bool((counts < 2).any()):
        raise LossInputError(
            f"rloo needs at least 2 samples per group (the baseline is the mean of the others); "
            f"group_ids has groups of size {sorted(set(counts.tolist()))}; sample several "
            "responses per prompt or use estimator='reinforce_pp'"
        )
    k = counts[inverse].to(rewards.dtype)
    others_mean = (group_sum(rewards, inverse, counts.numel())[inverse] - rewards) / (k - 1)
    mask = inp.mask
    return AdvantageOutput(
        advantages=broadcast_to_tokens(rewards - others_mean, mask),
        returns=broadcast_to_tokens(rewards, mask),
    )
