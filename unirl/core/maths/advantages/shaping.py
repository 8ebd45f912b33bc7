"""Reward and advantage shaping around an estimator: per-token rewards, KL-in-reward, and
on-policy distillation.

- KL in reward (Ziegler et al. 2019; InstructGPT): every valid token's reward loses
  ``coef * KL_t(old || ref)``, so the return itself penalises drifting from the reference.
- On-policy distillation (Agarwal et al. 2024, "On-Policy Distillation of Language Models";
  Thinking Machines, "On-Policy Distillation", 2025): the per-token reverse KL to a teacher on the
  student's own samples is a dense penalty added to the advantage,
  ``A_t - coef * (logp_student_t - logp_teacher_t)``.
"""

from __future__ import annotations

import torch

from unirl.core.maths.advantages.groups import float_dtype
from unirl.core.maths.advantages.inputs import AdvantageInputs
from unirl.core.maths.advantages.settings import AdvantageSettings
from unirl.core.maths.kl import kl_estimate


def last_token_mask(mask: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` bool: True at each row's last valid token (no True in an empty row)."""
    mask = mask.bool()
    if mask.shape[1] == 0:
        return mask
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    last = (mask * positions).amax(dim=1) - 1  # -1 for an empty row
    return positions[None, :] - 1 == last[:, None]


def apply_kl_in_reward(
    token_rewards: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    estimator: str,
) -> torch.Tensor:
    """``r_t - coef * KL_t(old || ref)`` on valid tokens; other entries unchanged."""
    kl = kl_estimate(old_logprobs, ref_logprobs, estimator).to(token_rewards.dtype)
    return torch.where(mask.bool(), token_rewards - coef * kl, token_rewards)


def apply_distillation(
    advantages: torch.Tensor,
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
) -> torch.Tensor:
    """``A_t - coef * (logp_student_t - logp_teacher_t)`` on valid tokens (the per-token reverse
    KL estimate on the student's own samples); other entries unchanged."""
    reverse_kl = (student_logprobs - teacher_logprobs).to(advantages.dtype)
    return torch.where(mask.bool(), advantages - coef * reverse_kl, advantages)


def token_level_rewards(
    inp: AdvantageInputs,
    settings: AdvantageSettings,
    outcome: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token rewards ``[B, L]`` of a token-level estimator, zero outside the mask.

    ``r_t = token_rewards_t + outcome * [t is the last valid token] - coef * KL_t(old || ref)``,
    with ``outcome`` = ``inp.rewards`` unless given (a baseline-subtracted copy, say).
    """
    outcome = inp.rewards if outcome is None else outcome
    dtype = float_dtype(outcome)
    if inp.token_rewards is not None:
        dtype = torch.promote_types(dtype, inp.token_rewards.dtype)
    mask = inp.mask
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    rewards_t = torch.where(last_token_mask(mask), outcome.to(dtype)[:, None], zero)
    if inp.token_rewards is not None:
        rewards_t = rewards_t + torch.where(mask, inp.token_rewards.to(dtype), zero)
    if settings.kl_in_reward_coef > 0:
        inp.require(
            ("old_logprobs", "ref_logprobs"),
            by=f"AdvantageSettings.kl_in_reward_coef={settings.kl_in_reward_coef}",
        )
        rewards_t = apply_kl_in_reward(
            rewards_t,
            inp.old_logprobs,
            inp.ref_logprobs,
            mask,
            settings.kl_in_reward_coef,
            settings.kl_in_reward_estimator,
        )
    return rewards_t
