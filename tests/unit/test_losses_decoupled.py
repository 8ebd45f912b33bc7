"""Decoupled PPO (AReaL) against a per-token formula written out here in plain Python, and the
roles each log-prob plays: current (with grad), proximal (the clip's "old"), behaviour (the
engine's: what TIS / IcePop and the decoupled weight divide by)."""

from __future__ import annotations

import math

import pytest
import torch

from unirl.core.data.counts import GlobalCounts
from unirl.core.errors import ConfigError, LossInputError
from unirl.core.maths.losses import LossInputs, LossSettings, compute_loss, reduce_metrics
from unirl.core.maths.losses.inputs import LOGPROB_ROLES

F64 = torch.float64

CURRENT = [-1.0, -2.0, -0.5, -1.5]
PROXIMAL = [-1.1, -1.8, -0.9, -1.5]
BEHAVIOUR = [-1.3, -1.0, -0.2, -4.0]  # token 3: exp(2.5) = 12.2 > cap 5 -> truncated
ADV = [1.0, -1.0, 1.0, -0.5]


def _inputs() -> LossInputs:
    return LossInputs(
        logprobs=torch.tensor(CURRENT, dtype=F64, requires_grad=True),
        old_logprobs=torch.tensor(PROXIMAL, dtype=F64),
        rollout_logprobs=torch.tensor(BEHAVIOUR, dtype=F64),
        advantages=torch.tensor(ADV, dtype=F64),
        loss_mask=torch.ones(4, dtype=torch.bool),
        seq_ids=torch.zeros(4, dtype=torch.long),
        num_seqs=1,
        seq_token_counts=torch.tensor([4]),
    )


def _reference(
    cap: float, eps: float = 0.2, mode: str = "truncate"
) -> tuple[float, list[float], float, float]:
    """Per token: w = min(exp(prox - behav), cap) (mask: w = 0 past the cap, AReaL's code: the
    token stays in the token count T); r = exp(cur - prox);
    loss = w * max(-A r, -A clip(r, 1-eps, 1+eps)); token-mean. Gradient by hand: the unclipped
    branch's d/dcur is -w A r / T, the clipped branch's 0."""
    losses, grads, weights, truncated = [], [], [], 0
    for cur, prox, behav, a in zip(CURRENT, PROXIMAL, BEHAVIOUR, ADV):
        w = min(math.exp(prox - behav), cap)
        if mode == "mask" and math.exp(prox - behav) > cap:
            w = 0.0
        truncated += math.exp(prox - behav) > cap
        r = math.exp(cur - prox)
        unclipped, clipped = -a * r, -a * min(max(r, 1 - eps), 1 + eps)
        losses.append(w * max(unclipped, clipped))
        grads.append(-w * a * r / 4 if unclipped >= clipped else 0.0)
        weights.append(w)
    return sum(losses) / 4, grads, sum(weights) / 4, truncated / 4


@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("cap", [5.0, 1.5])
def test_decoupled_matches_per_token_formula(cap, mode):
    inp = _inputs()
    out = compute_loss(inp, GlobalCounts(tokens=4, sequences=1), LossSettings(
        decoupled=True, decoupled_cap=cap, decoupled_cap_mode=mode
    ))  # fmt: skip
    (grad,) = torch.autograd.grad(out.loss, inp.logprobs)
    loss, grads, w_mean, clipfrac = _reference(cap, mode=mode)
    if mode == "mask":  # a token past the cap has no gradient at all
        assert [g for g, w in zip(grad.tolist(), _past_cap(cap)) if w] == [0.0] * sum(
            _past_cap(cap)
        )
    m = reduce_metrics([out.metrics])
    assert out.loss.item() == pytest.approx(loss)
    assert grad.tolist() == pytest.approx(grads)
    assert m["decoupled_weight_mean"] == pytest.approx(w_mean)
    assert m["decoupled_clipfrac"] == pytest.approx(clipfrac)


def _past_cap(cap: float) -> list[bool]:
    return [math.exp(p - b) > cap for p, b in zip(PROXIMAL, BEHAVIOUR)]


def test_decoupled_cap_mode_is_a_config_key():
    from tests.unit.test_config import base
    from unirl.core.config.run_config import config_from_dict

    cfg = config_from_dict(base(algorithm={"decoupled": True, "decoupled_cap_mode": "mask"}))
    assert cfg.algorithm.loss_settings().decoupled_cap_mode == "mask"
    with pytest.raises(ConfigError, match=r"algorithm.decoupled_cap_mode"):
        config_from_dict(base(algorithm={"decoupled_cap_mode": "drop"}))


def test_decoupled_off_is_plain_ppo_against_proximal():
    inp = _inputs()
    out = compute_loss(inp, GlobalCounts(tokens=4, sequences=1), LossSettings())
    plain = 0.0
    for cur, prox, a in zip(CURRENT, PROXIMAL, ADV):
        r = math.exp(cur - prox)
        plain += max(-a * r, -a * min(max(r, 0.8), 1.2)) / 4
    assert out.loss.item() == pytest.approx(plain)
    assert "decoupled_weight_mean" not in out.metrics
    assert _reference(cap=5.0)[0] != pytest.approx(plain)  # the weight matters on this data


def test_tis_divides_by_the_behaviour_logprobs():
    # TIS's weight is min(exp(proximal - behaviour), high) on the same roles.
    inp = _inputs()
    s = LossSettings(rollout_correction="tis", rollout_correction_high=5.0)
    m = reduce_metrics([compute_loss(inp, GlobalCounts(tokens=4, sequences=1), s).metrics])
    expect = sum(min(math.exp(p - b), 5.0) for p, b in zip(PROXIMAL, BEHAVIOUR)) / 4
    assert m["is_weight_mean"] == pytest.approx(expect)


def test_roles_name_the_fields():
    inp = _inputs()
    assert LOGPROB_ROLES == {
        "current": "logprobs",
        "proximal": "old_logprobs",
        "behaviour": "rollout_logprobs",
    }
    assert inp.behaviour_logprobs is inp.rollout_logprobs
    assert inp.proximal_logprobs() is inp.old_logprobs


def test_decoupled_needs_behaviour_logprobs():
    inp = LossInputs(**{**{k: getattr(_inputs(), k) for k in (
        "logprobs", "old_logprobs", "advantages", "loss_mask", "seq_ids", "num_seqs",
        "seq_token_counts",
    )}})  # fmt: skip
    with pytest.raises(LossInputError, match=r"decoupled=True needs LossInputs\.rollout_logprobs"):
        compute_loss(inp, GlobalCounts(tokens=4, sequences=1), LossSettings(decoupled=True))


def test_decoupled_settings_errors():
    with pytest.raises(ConfigError, match=r"decoupled_cap=0\.5 must be >= 1"):
        LossSettings(decoupled=True, decoupled_cap=0.5)
    with pytest.raises(ConfigError, match="weights each token by the proximal / behaviour"):
        LossSettings(decoupled=True, rollout_correction="tis")
