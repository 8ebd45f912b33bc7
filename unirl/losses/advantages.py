"""Advantage estimators on padded tensors: ``[B]`` outcome rewards or ``[B, L]`` token rewards.

A thin call of `unirl.core.maths.advantages.compute_advantages`, the function unirl's trainer
calls once per rollout, so the batch whitening of REINFORCE++ (and ``settings.whiten``) happens
here too, over ``group``'s ranks when the batch is split across data-parallel ranks.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from unirl.core.errors import ConfigError, LossInputError
from unirl.core.maths.advantages import (
    AdvantageInputs,
    AdvantageSettings,
    compute_advantages,
    get_advantage_estimator,
)

_DEFAULT_ESTIMATOR = attrs.fields(AdvantageSettings).estimator.default


def advantages(
    name: str,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_ids: torch.Tensor | None = None,
    settings: AdvantageSettings | None = None,
    values: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    teacher_logprobs: torch.Tensor | None = None,
    group: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)``, both ``[B, L]`` and zero outside ``mask``.

    - ``name``: ``grpo``, ``dr_grpo``, ``rloo``, ``reinforce_pp``, ``reinforce_pp_baseline``,
      ``gae`` or ``"package.module:function"``.
    - ``rewards``: ``[B]`` outcome rewards, or ``[B, L]`` per-token rewards (token-level
      estimators only: ``reinforce_pp``, ``gae``).
    - ``group_ids`` ``[B]`` integers, samples of one prompt share an id: needed by the
      group-relative estimators; others treat each sample as its own group.
    - ``values`` (GAE), ``old_logprobs`` / ``ref_logprobs`` (KL in the reward),
      ``teacher_logprobs`` (distillation): ``[B, L]``, when the settings use them.
    - ``group``: the process group whose ranks together hold the batch (batch whitening).
    """
    fn = "advantages"
    if settings is None:
        settings = AdvantageSettings(estimator=name)
    elif settings.estimator not in (name, _DEFAULT_ESTIMATOR):
        raise ConfigError(
            f"{fn}: name={name!r} but settings.estimator={settings.estimator!r}; pass one "
            "estimator (the name wins only over the default)"
        )
    else:
        settings = attrs.evolve(settings, estimator=name)
    for arg, x in (("rewards", rewards), ("mask", mask)):
        if not isinstance(x, torch.Tensor):
            raise LossInputError(f"{fn}: {arg} must be a torch.Tensor, got {type(x).__name__}")
    if mask.dim() != 2:
        raise LossInputError(f"{fn}: mask must be [B, L], got shape {tuple(mask.shape)}")
    b = mask.shape[0]
    token_rewards = None
    if rewards.dim() == 2:
        # Per-token rewards: the outcome part is zero (AdvantageInputs adds the two).
        token_rewards, rewards = rewards, torch.zeros(b, dtype=rewards.dtype, device=rewards.device)
    if group_ids is None:
        if get_advantage_estimator(name).needs_groups:
            raise LossInputError(
                f"{fn}: estimator {name!r} normalises within groups; pass group_ids [B] "
                "(samples of one prompt share an id)"
            )
        group_ids = torch.arange(b, device=mask.device)
    out = compute_advantages(
        AdvantageInputs(
            rewards=rewards,
            group_ids=group_ids,
            response_mask=mask,
            token_rewards=token_rewards,
            values=values,
            old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs,
            teacher_logprobs=teacher_logprobs,
        ),
        settings,
        group=group,
    )
    return out.advantages, out.returns
