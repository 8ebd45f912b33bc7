"""Correction for the rollout engine's log-probs differing from the trainer's.

The rollout engine (vLLM, SGLang) samples with kernels, precision and sometimes quantisation that
differ from the trainer's, so its distribution ``pi_rollout`` is not the trainer's pre-step policy
``pi_old`` even for the same weights. The policy gradient is then off-policy; each mode weights
each token's policy-gradient term by a DETACHED factor built from
``x_t = old_logp_t - rollout_logp_t`` (``rho_t = exp(x_t)``):

- ``tis``  truncated importance sampling (Yao et al., "Your Efficient RL Framework Secretly
  Brings You Off-Policy RL Training", 2025): ``w_t = min(rho_t, high)``.
- ``icepop`` masked importance sampling (Ling team, "IcePop", 2025): ``w_t = rho_t`` inside
  ``[low, high]``, 0 outside — tokens with a large mismatch are dropped, not down-weighted.
- ``seq_mask`` the whole sequence gets weight 0 when its geometric-mean ratio
  ``exp(mean_t x_t)`` (over its valid tokens, summed across CP ranks) leaves ``[low, high]``,
  else 1.

Metrics: ``is_weight_mean`` (mean weight over valid tokens) and ``is_clipfrac`` (fraction of
valid tokens whose weight was truncated or masked).
"""

from __future__ import annotations

import math

import torch

from unirl.core.errors import LossInputError
from unirl.core.maths.losses.aggregation import token_mean_metric
from unirl.core.maths.losses.inputs import LossInputs
from unirl.core.maths.losses.metrics import Metric
from unirl.core.maths.losses.sequence import sequence_mean
from unirl.core.maths.losses.settings import LossSettings


def _log(bound: float) -> float:
    return math.log(bound) if bound > 0 else -math.inf


def rollout_correction_weight(
    inp: LossInputs, settings: LossSettings
) -> tuple[torch.Tensor | None, dict[str, Metric]]:
    """The detached per-token weight of the policy-gradient term, or None for mode ``none``."""
    mode = settings.rollout_correction
    if mode == "none":
        return None, {}
    if inp.rollout_logprobs is None:
        raise LossInputError(
            f"rollout_correction={mode!r} needs LossInputs.rollout_logprobs (the rollout "
            "engine's log-probs of the sampled tokens); return them from the rollout engine or "
            "set rollout_correction: none"
        )
    x = (inp.resolved_old_logprobs() - inp.rollout_logprobs).detach()
    log_low = _log(settings.rollout_correction_low)
    log_high = _log(settings.rollout_correction_high)
    if mode == "tis":
        weight = torch.exp(x.clamp(max=log_high))  # min(rho, high) without overflow
        outside = x > log_high
    elif mode == "icepop":
        inside = (x >= log_low) & (x <= log_high)
        weight = torch.where(inside, torch.exp(x.clamp(max=log_high)), torch.zeros_like(x))
        outside = ~inside
    else:  # seq_mask
        seq_x = sequence_mean(x, inp.mask, inp.seq_ids, inp.seq_token_counts, inp.cp_group)
        inside = ((seq_x >= log_low) & (seq_x <= log_high))[inp.seq_ids]
        weight = inside.to(x.dtype)
        outside = ~inside
    metrics = {
        "is_weight_mean": token_mean_metric(weight, inp.mask),
        "is_clipfrac": token_mean_metric(outside, inp.mask),
    }
    return weight, metrics
