"""Per-token KL estimators between the policy and a reference, from log-probs.

With ``log_ratio = logp - ref_logp`` (Schulman, "Approximating KL Divergence", 2020):

- ``k1``: ``log_ratio`` — unbiased, high variance, can be negative.
- ``k2``: ``0.5 * log_ratio**2`` — biased, low variance; its gradient is the true KL's gradient.
- ``k3``: ``exp(-log_ratio) + log_ratio - 1`` — unbiased and non-negative.
- ``low_var_kl``: ``k3`` clamped to [-10, 10] (verl's name), robust to outliers.
- ``k3+``: the value of ``k3`` with the gradient of ``k2`` (straight-through).

Sign convention everywhere in unirl: KL(policy || reference), positive when the policy moves away.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from unirl.core.errors import LossInputError

KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _k1(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return logp - ref


def _k2(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref).square()


def _k3(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    neg_log_ratio = ref - logp
    return torch.exp(neg_log_ratio) - neg_log_ratio - 1.0


def _low_var_kl(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return torch.clamp(_k3(logp, ref), min=-10.0, max=10.0)


def _k3_plus(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    k2 = _k2(logp, ref)
    return k2 + (_k3(logp, ref) - k2).detach()


KL_ESTIMATORS: dict[str, KLEstimator] = {
    "k1": _k1,
    "k2": _k2,
    "k3": _k3,
    "low_var_kl": _low_var_kl,
    "k3+": _k3_plus,
}


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimate; raises `LossInputError` naming the estimator or the shapes."""
    try:
        fn = KL_ESTIMATORS[estimator]
    except KeyError:
        raise LossInputError(
            f"unknown KL estimator {estimator!r}; valid: {sorted(KL_ESTIMATORS)}"
        ) from None
    if logp.shape != ref_logp.shape:
        raise LossInputError(
            f"KL estimate: logprobs shape {tuple(logp.shape)} != ref_logprobs shape "
            f"{tuple(ref_logp.shape)}"
        )
    return fn(logp, ref_logp)
