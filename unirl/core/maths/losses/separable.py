"""Whether a loss configuration is a sum over tokens of a function of each token's own log-prob and
entropy — the condition for the fused head to take the loss into each token chunk
(`unirl.core.maths.head_loss`: three head matmuls instead of four, no logits kept).

Per token ``total_t = w_t pg_t + kl_loss_coef kl_t - entropy_coef H_t`` and every aggregation
mode divides ``sum_t a_t total_t`` by a step constant, with ``a_t`` the mask or ``m_t / n_i``
(the sequence's GLOBAL valid-token count): both known before the forward, so the aggregation is
separable whatever the mode. What can couple tokens is the policy loss (GSPO's sequence ratio: each
loss declares it, `register_policy_loss(separable=...)`) and ``rollout_correction: seq_mask``
(a sequence's mean log-ratio, summed over context-parallel ranks in every loss call).
"""

from __future__ import annotations

import attrs

from unirl.core.maths.losses.registry import policy_loss_is_separable
from unirl.core.maths.losses.settings import LossSettings


@attrs.frozen
class Separability:
    """The answer and why, for `unirl check`."""

    separable: bool
    reason: str


def separability(settings: LossSettings) -> Separability:
    """Whether ``settings`` make the policy's loss separable over tokens (see the module
    docstring)."""
    name = settings.policy_loss
    if not policy_loss_is_separable(name):
        how = (
            "set `fn.separable = True` on it (or register it with separable=True) if each "
            "token's loss depends only on that token's log-prob"
            if ":" in name
            else "its tokens' gradients depend on other tokens' log-probs (a sequence-level "
            "ratio or mean)"
        )
        return Separability(False, f"policy_loss {name!r} is not separable over tokens: {how}")
    if settings.rollout_correction == "seq_mask":
        return Separability(
            False,
            "rollout_correction 'seq_mask' weighs each sequence by its mean log-ratio, a sum "
            "over the sequence's tokens (and context-parallel ranks) in every loss call",
        )
    terms = [f"policy_loss {name!r}"]
    if settings.rollout_correction != "none":
        terms.append(f"rollout_correction {settings.rollout_correction!r}")
    if settings.kl_loss_coef != 0:
        terms.append(f"KL term ({settings.kl_loss_estimator})")
    if settings.entropy_coef != 0:
        terms.append("entropy term")
    return Separability(
        True,
        f"{', '.join(terms)} with {settings.loss_aggregation} aggregation: a sum over tokens of "
        "each token's own terms (the step's global counts are known before the forward)",
    )
