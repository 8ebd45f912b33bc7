"""Per-group statistics for group-relative estimators (GRPO, RLOO, REINFORCE++ baseline).

Samples of one prompt share a group id; ids need not be contiguous or sorted. Everything is
computed with scatter-adds on the rewards' device, without a host sync.
"""

from __future__ import annotations

import torch

from unirl.core.errors import ConfigError, LossInputError
from unirl.core.maths.advantages.inputs import AdvantageInputs
from unirl.core.maths.advantages.settings import AdvantageSettings


def float_dtype(x: torch.Tensor) -> torch.dtype:
    """At least fp32: bf16 rewards would lose the small differences advantages are made of."""
    return torch.promote_types(x.dtype, torch.float32)


def group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inverse [B], counts [G])``: each sample's group slot and each group's size."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return inverse, counts


def group_sum(x: torch.Tensor, inverse: torch.Tensor, num_groups: int) -> torch.Tensor:
    return torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add_(0, inverse, x)


def group_mean(x: torch.Tensor, inverse: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Each sample's group mean, ``[B]``."""
    return (group_sum(x, inverse, counts.numel()) / counts.to(x.dtype))[inverse]


def sequence_rewards(inp: AdvantageInputs, settings: AdvantageSettings, name: str) -> torch.Tensor:
    """The rewards ``[B]`` of a sequence-level estimator, refusing the token-level inputs and
    settings it would otherwise silently ignore."""
    if inp.token_rewards is not None:
        raise LossInputError(
            f"estimator {name!r} scores whole sequences from rewards [B], but token_rewards were "
            "given; sum them into rewards or use a token-level estimator (reinforce_pp, gae)"
        )
    if settings.kl_in_reward_coef > 0:
        raise ConfigError(
            f"AdvantageSettings.kl_in_reward_coef={settings.kl_in_reward_coef} shapes per-token "
            f"rewards, which estimator {name!r} does not use; set it to 0 and use the loss's KL "
            "term, or pick a token-level estimator (reinforce_pp, reinforce_pp_baseline, gae)"
        )
    return inp.rewards.to(float_dtype(inp.rewards))


def broadcast_to_tokens(per_sample: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B] -> [B, L]``: the same value on every valid token, zero elsewhere."""
    return torch.where(mask, per_sample[:, None], torch.zeros((), dtype=per_sample.dtype))
