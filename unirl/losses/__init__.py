"""unirl's losses for other RL frameworks: right-padded ``[B, L]`` tensors with a mask.

    from unirl.losses import LossSettings, policy_loss

    loss, metrics = policy_loss(
        "gspo", logprobs, old_logprobs, advantages, mask,          # [B, L] each
        settings=LossSettings(clip_low=3e-4, clip_high=4e-4, loss_aggregation="seq-mean-token-mean"),
    )
    loss.backward()                                                  # metrics: dict[str, float]

A thin layer over `unirl.core.maths.losses` and `unirl.core.maths.advantages` (the code unirl's
own trainer runs), not a second implementation. Counts of the optimizer step default to the
batch's own; under data parallel or gradient accumulation pass the all-reduced ones
(`global_counts(mask, group=...)`; see `unirl.losses.padded`). Adapters: `unirl.integrations.trl`, `unirl.integrations.verl`.
"""

from unirl.core.maths.advantages import AdvantageSettings
from unirl.core.maths.losses import LossSettings
from unirl.losses.advantages import advantages
from unirl.losses.padded import global_counts
from unirl.losses.policy import kl_loss, policy_loss, value_loss

__all__ = [
    "AdvantageSettings",
    "LossSettings",
    "advantages",
    "global_counts",
    "kl_loss",
    "policy_loss",
    "value_loss",
]
