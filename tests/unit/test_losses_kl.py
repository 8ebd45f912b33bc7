"""`unirl.core.maths.kl` estimators: hand-computed values, a per-token Python loop over random
log-probs, and their gradients."""

from __future__ import annotations

import math

import pytest
import torch

from unirl.core.errors import LossInputError
from unirl.core.maths.kl import KL_ESTIMATORS, kl_estimate

F64 = torch.float64


def test_hand_values():
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=F64)
    ref = torch.tensor([-1.5, -2.0, 0.0], dtype=F64)
    # d = logp - ref = [0.5, 0, -0.5]
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx([0.5, 0.0, -0.5])
    # k2 = d^2 / 2 = [0.125, 0, 0.125]
    assert kl_estimate(logp, ref, "k2").tolist() == pytest.approx([0.125, 0.0, 0.125])
    # k3 = exp(-d) + d - 1: e^-0.5 - 0.5 = 0.1065307, 0, e^0.5 - 1.5 = 0.1487213
    k3 = [0.6065306597 + 0.5 - 1.0, 0.0, 1.6487212707 - 0.5 - 1.0]
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx(k3)
    assert kl_estimate(logp, ref, "low_var_kl").tolist() == pytest.approx(k3)
    assert kl_estimate(logp, ref, "k3+").tolist() == pytest.approx(k3)


def test_low_var_kl_clamps_at_10():
    # d = -5: k3 = e^5 - 5 - 1 = 142.41 -> clamped to 10, and no gradient through the clamp
    logp = torch.tensor([-6.0], dtype=F64, requires_grad=True)
    ref = torch.tensor([-1.0], dtype=F64)
    out = kl_estimate(logp, ref, "low_var_kl")
    assert out.item() == 10.0
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(math.exp(5) - 6)
    (g,) = torch.autograd.grad(out.sum(), logp)
    assert g.item() == 0.0


def _loop(estimator: str, d: float) -> float:
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    k3 = math.exp(-d) + d - 1.0
    return min(max(k3, -10.0), 10.0) if estimator == "low_var_kl" else k3


def _loop_grad(estimator: str, d: float) -> float:
    # derivative with respect to logp (d = logp - ref)
    if estimator == "k1":
        return 1.0
    if estimator in ("k2", "k3+"):  # k3+ carries k2's gradient
        return d
    if estimator == "low_var_kl" and math.exp(-d) + d - 1.0 > 10.0:
        return 0.0
    return 1.0 - math.exp(-d)


@pytest.mark.parametrize("estimator", sorted(KL_ESTIMATORS))
def test_random_against_loop(estimator):
    g = torch.Generator().manual_seed(0)
    ref = -torch.rand(64, generator=g, dtype=F64) * 3
    logp = (ref + torch.randn(64, generator=g, dtype=F64) * 1.5).requires_grad_()
    out = kl_estimate(logp, ref, estimator)
    (grad,) = torch.autograd.grad(out.sum(), logp)
    for t in range(64):
        d = logp[t].item() - ref[t].item()
        assert out[t].item() == pytest.approx(_loop(estimator, d), rel=1e-12, abs=1e-12)
        assert grad[t].item() == pytest.approx(_loop_grad(estimator, d), rel=1e-12, abs=1e-12)


def test_unknown_estimator():
    with pytest.raises(LossInputError, match=r"unknown KL estimator 'k9'.*low_var_kl"):
        kl_estimate(torch.zeros(2), torch.zeros(2), "k9")


def test_shape_mismatch():
    with pytest.raises(LossInputError, match="ref_logprobs shape"):
        kl_estimate(torch.zeros(2), torch.zeros(3), "k1")
