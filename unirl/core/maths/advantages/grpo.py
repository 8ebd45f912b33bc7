"""GRPO and Dr.GRPO: the group-relative outcome advantage.

GRPO (Shao et al. 2024, "DeepSeekMath"), per group of samples of one prompt::

    A_i = (r_i - mean_g(r)) / (std_g(r) + epsilon)     on every response token of sample i

Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training") drops the std division, which
biases updates toward prompts whose rewards barely differ: ``A_i = r_i - mean_g(r)``. Select it
with ``estimator="dr_grpo"`` or ``estimator="grpo", std_normalize=False``.

``std_g`` is the *unbiased* (Bessel-corrected, ``n - 1``) standard deviation, as in
``torch.std``: verl and TRL use it, so results match theirs. A group of one sample has no
spread: its advantage is ``r - r = 0`` (the std is not used). A group whose rewards are all equal
has ``r_i - mean = 0`` and std 0, so the advantage is 0, not NaN (epsilon keeps the division
finite).
"""

from __future__ import annotations

from unirl.core.maths.advantages.groups import (
    broadcast_to_tokens,
    group_index,
    group_mean,
    group_sum,
    sequence_rewards,
)
from unirl.core.maths.advantages.inputs import AdvantageInputs
from unirl.core.maths.advantages.output import AdvantageOutput
from unirl.core.maths.advantages.registry import register_advantage_estimator
from unirl.core.maths.advantages.settings import AdvantageSettings


def group_normalized(
    inp: AdvantageInputs, settings: AdvantageSettings, *, std_normalize: bool, name: str
) -> AdvantageOutput:
    rewards = sequence_rewards(inp, settings, name)
    inverse, counts = group_index(inp.group_ids)
    centered = rewards - group_mean(rewards, inverse, counts)
    scores = centered
    if std_normalize:
        # Two-pass variance (sum of squared deviations): no cancellation for large rewards.
        sq = group_sum(centered.square(), inverse, counts.numel())
        bessel = (counts - 1).clamp(min=1).to(rewards.dtype)  # a group of one: centered is 0
        std = (sq / bessel).sqrt()[inverse]
        scores = centered / (std + settings.epsilon)
    mask = inp.mask
    return AdvantageOutput(
        advantages=broadcast_to_tokens(scores, mask),
        returns=broadcast_to_tokens(rewards, mask),  # the undiscounted outcome return
    )


@register_advantage_estimator("grpo", needs_groups=True)
def grpo(inp: AdvantageInputs, settings: AdvantageSettings) -> AdvantageOutput:
    """GRPO; divides by the group std unless ``settings.std_normalize`` is False."""
    return group_normalized(inp, settings, std_normalize=settings.std_normalize, name="grpo")


@register_advantage_estimator("dr_grpo", needs_groups=True)
def dr_grpo(inp: AdvantageInputs, settings: AdvantageSettings) -> AdvantageOutput:
    """Dr.GRPO: ``r_i - mean_g(r)``, whatever ``settings.std_normalize`` says."""
    return group_normalized(inp, settings, std_normalize=False, name="dr_grpo")
