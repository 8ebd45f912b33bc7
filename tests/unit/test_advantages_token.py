"""REINFORCE++, REINFORCE++-baseline and GAE against hand-computed cases and Python loops."""

from __future__ import annotations

import math
import statistics

import attrs
import pytest
import torch

from unirl.core.errors import LossInputError
from unirl.core.maths.advantages import (
    AdvantageInputs,
    AdvantageSettings,
    apply_kl_in_reward,
    compute_advantages,
    gae,
    reinforce_pp,
)

WHITEN_EPS = 1e-8


def make_batch(seed: int, num_groups: int, group_size: int, max_len: int, holes: bool = False):
    g = torch.Generator().manual_seed(seed)
    b = num_groups * group_size
    lengths = torch.randint(0, max_len + 1, (b,), generator=g)
    lengths[0] = 1  # always one one-token response
    mask = torch.arange(max_len)[None, :] < lengths[:, None]
    if holes:
        mask &= torch.rand(b, max_len, generator=g) > 0.25
    perm = torch.randperm(b, generator=g)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return AdvantageInputs(
        rewards=rand(b),
        group_ids=(torch.arange(b) // group_size)[perm],
        response_mask=mask,
        old_logprobs=-rand(b, max_len).abs(),
        ref_logprobs=-rand(b, max_len).abs(),
        values=rand(b, max_len),
        token_rewards=0.1 * rand(b, max_len),
    )


# -- Python-float references -----------------------------------------------------------------


def kl_ref(old: float, ref: float, estimator: str) -> float:
    if estimator == "k1":
        return old - ref
    if estimator == "k3":  # exp(ref - old) - (ref - old) - 1
        return math.exp(ref - old) - (ref - old) - 1
    raise AssertionError(estimator)


def token_rewards_ref(inp, s: AdvantageSettings, baseline: bool, use_token_rewards: bool):
    """{sample: {valid t: r_t}} with the outcome at the last valid token and KL shaping."""
    r, gid, m = inp.rewards.tolist(), inp.group_ids.tolist(), inp.response_mask.tolist()
    out = {}
    for i in range(len(r)):
        outcome = r[i]
        if baseline:
            members = [r[j] for j in range(len(r)) if gid[j] == gid[i]]
            outcome -= sum(members) / len(members)
        valid = [t for t, mt in enumerate(m[i]) if mt]
        rt = {}
        for t in valid:
            x = inp.token_rewards[i, t].item() if use_token_rewards else 0.0
            if t == valid[-1]:
                x += outcome
            if s.kl_in_reward_coef > 0:
                old, ref = inp.old_logprobs[i, t].item(), inp.ref_logprobs[i, t].item()
                x -= s.kl_in_reward_coef * kl_ref(old, ref, s.kl_in_reward_estimator)
            rt[t] = x
        out[i] = rt
    return out


def reinforce_ref(inp, s, baseline=False, use_token_rewards=True):
    rewards = token_rewards_ref(inp, s, baseline, use_token_rewards)
    returns = {}
    for i, rt in rewards.items():
        g = 0.0
        for t in sorted(rt, reverse=True):
            g = rt[t] + s.gamma * g
            returns[i, t] = g
    # whiten over all valid tokens of the batch, unbiased variance
    vals = list(returns.values())
    mean = statistics.mean(vals)
    var = statistics.variance(vals) if len(vals) > 1 else 0.0
    b, length = inp.response_mask.shape
    adv = torch.zeros(b, length, dtype=torch.float64)
    ret = torch.zeros(b, length, dtype=torch.float64)
    for (i, t), g in returns.items():
        adv[i, t] = (g - mean) / math.sqrt(var + WHITEN_EPS)
        ret[i, t] = g
    return adv, ret


def gae_ref(inp, s, use_token_rewards=True):
    rewards = token_rewards_ref(inp, s, False, use_token_rewards)
    b, length = inp.response_mask.shape
    adv = torch.zeros(b, length, dtype=torch.float64)
    ret = torch.zeros(b, length, dtype=torch.float64)
    for i, rt in rewards.items():
        next_v, next_a = 0.0, 0.0
        for t in sorted(rt, reverse=True):
            v = inp.values[i, t].item()
            delta = rt[t] + s.gamma * next_v - v
            a = delta + s.gamma * s.lam * next_a
            adv[i, t], ret[i, t] = a, a + v
            next_v, next_a = v, a
    return adv, ret


def without_token_rewards(inp: AdvantageInputs) -> AdvantageInputs:
    return attrs.evolve(inp, token_rewards=None)


# -- REINFORCE++ -----------------------------------------------------------------------------


def single(rewards, mask, **tensors):
    b = len(rewards)
    return AdvantageInputs(
        rewards=torch.tensor(rewards, dtype=torch.float64),
        group_ids=torch.arange(b),
        response_mask=torch.tensor(mask),
        **{k: torch.tensor(v, dtype=torch.float64) for k, v in tensors.items()},
    )


def test_reinforce_pp_hand_computed():
    # gamma 0.5, reward 1, mask [1, 1, 1, 0], kl coef 0.1 with k1, old - ref = [0.2, -0.4, 0.6, x]
    # r_t = [-0.02, 0.04, 1 - 0.06 = 0.94]
    # G_2 = 0.94; G_1 = 0.04 + 0.5 * 0.94 = 0.51; G_0 = -0.02 + 0.5 * 0.51 = 0.235
    inp = single(
        [1.0],
        [[1, 1, 1, 0]],
        old_logprobs=[[-0.3, -0.9, -0.1, 0.0]],
        ref_logprobs=[[-0.5, -0.5, -0.7, -9.0]],
    )
    s = AdvantageSettings(estimator="reinforce_pp", gamma=0.5, kl_in_reward_coef=0.1)
    raw = reinforce_pp(inp, s)
    torch.testing.assert_close(
        raw.advantages, torch.tensor([[0.235, 0.51, 0.94, 0.0]], dtype=torch.float64)
    )
    # whitened: mean 0.5616667, unbiased std 0.3553285 -> [-0.9193371, -0.1454054, 1.0647424]
    out = compute_advantages(inp, s)
    torch.testing.assert_close(
        out.advantages,
        torch.tensor([[-0.9193371, -0.1454054, 1.0647424, 0.0]], dtype=torch.float64),
        atol=1e-6,
        rtol=0,
    )
    torch.testing.assert_close(out.returns, raw.returns)


def test_reinforce_pp_hole_and_token_rewards():
    # mask [1, 0, 1], gamma 0.5, reward 1, token_rewards [0.1, 99 (masked), 0.3]:
    # r = [0.1, -, 1.3]; G_2 = 1.3; G_0 = 0.1 + 0.5 * 1.3 = 0.75 (the hole does not discount)
    inp = single([1.0], [[1, 0, 1]], token_rewards=[[0.1, 99.0, 0.3]])
    raw = reinforce_pp(inp, AdvantageSettings(gamma=0.5))
    torch.testing.assert_close(raw.returns, torch.tensor([[0.75, 0.0, 1.3]], dtype=torch.float64))
    # gamma 1 (the reverse-cumsum path): G_2 = 1.3; G_0 = 0.1 + 1.3 = 1.4
    raw = reinforce_pp(inp, AdvantageSettings(gamma=1.0))
    torch.testing.assert_close(raw.returns, torch.tensor([[1.4, 0.0, 1.3]], dtype=torch.float64))


def test_reinforce_pp_baseline_hand_computed():
    # group rewards [1, 0], gamma 1: centred [0.5, -0.5] on both tokens of each sample.
    # whitening [0.5, 0.5, -0.5, -0.5]: mean 0, unbiased var 4 * 0.25 / 3 = 1/3,
    # A = ±0.5 / sqrt(1/3 + 1e-8) = ±0.8660254
    inp = AdvantageInputs(
        rewards=torch.tensor([1.0, 0.0], dtype=torch.float64),
        group_ids=torch.tensor([4, 4]),
        response_mask=torch.ones(2, 2),
    )
    out = compute_advantages(inp, AdvantageSettings(estimator="reinforce_pp_baseline"))
    a = 0.5 / math.sqrt(1 / 3 + 1e-8)
    expected = torch.tensor([[a, a], [-a, -a]], dtype=torch.float64)
    torch.testing.assert_close(out.advantages, expected)


def test_kl_in_reward_k3_hand_computed():
    # old -1.0, ref -1.5: log ratio 0.5, k3 = exp(-0.5) + 0.5 - 1 = 0.1065307; coef 0.5:
    # r = 1 - 0.5 * 0.1065307 = 0.9467347; the masked second token stays 7.
    shaped = apply_kl_in_reward(
        torch.tensor([[1.0, 7.0]], dtype=torch.float64),
        torch.tensor([[-1.0, 0.0]], dtype=torch.float64),
        torch.tensor([[-1.5, float("nan")]], dtype=torch.float64),
        torch.tensor([[1, 0]]),
        0.5,
        "k3",
    )
    torch.testing.assert_close(
        shaped, torch.tensor([[0.9467347, 7.0]], dtype=torch.float64), atol=1e-7, rtol=0
    )


@pytest.mark.parametrize("estimator", ["reinforce_pp", "reinforce_pp_baseline"])
@pytest.mark.parametrize(
    "seed,gamma,coef,kl,holes",
    [
        (0, 1.0, 0.0, "k1", False),
        (3, 1.0, 0.1, "k1", True),
        (1, 0.9, 0.05, "k1", True),
        (2, 0.7, 0.2, "k3", True),
    ],
)
def test_reinforce_pp_matches_loop_reference(estimator, seed, gamma, coef, kl, holes):
    inp = make_batch(seed, num_groups=3, group_size=4, max_len=9, holes=holes)
    s = AdvantageSettings(
        estimator=estimator, gamma=gamma, kl_in_reward_coef=coef, kl_in_reward_estimator=kl
    )
    out = compute_advantages(inp, s)
    adv, ret = reinforce_ref(inp, s, baseline=estimator.endswith("baseline"))
    torch.testing.assert_close(out.advantages, adv)
    torch.testing.assert_close(out.returns, ret)


def test_reinforce_pp_baseline_group_of_one_is_zero():
    # each sample alone: centred reward r - r = 0 everywhere -> whitened zeros
    inp = single([2.0, -3.0], [[1, 1], [1, 0]])
    out = compute_advantages(inp, AdvantageSettings(estimator="reinforce_pp_baseline"))
    assert torch.equal(out.advantages, torch.zeros(2, 2, dtype=torch.float64))


# -- GAE -------------------------------------------------------------------------------------


def test_gae_hand_computed():
    # V = [0.5, 0.2, 0.4], reward 1 at the last token, gamma 0.9, lam 0.8 (gamma * lam = 0.72):
    # delta_2 = 1 + 0 - 0.4 = 0.6;             A_2 = 0.6
    # delta_1 = 0 + 0.9 * 0.4 - 0.2 = 0.16;    A_1 = 0.16 + 0.72 * 0.6 = 0.592
    # delta_0 = 0 + 0.9 * 0.2 - 0.5 = -0.32;   A_0 = -0.32 + 0.72 * 0.592 = 0.10624
    # returns = A + V = [0.60624, 0.792, 1.0]
    inp = single([1.0], [[1, 1, 1, 0]], values=[[0.5, 0.2, 0.4, 5.0]])
    out = compute_advantages(inp, AdvantageSettings(estimator="gae", gamma=0.9, lam=0.8))
    torch.testing.assert_close(
        out.advantages, torch.tensor([[0.10624, 0.592, 0.6, 0.0]], dtype=torch.float64)
    )
    torch.testing.assert_close(
        out.returns, torch.tensor([[0.60624, 0.792, 1.0, 0.0]], dtype=torch.float64)
    )


def test_gae_gamma_lam_one_is_return_minus_value():
    # gamma = lam = 1: A_t = R - V_t = 1 - [0.5, 0.2, 0.4] = [0.5, 0.8, 0.6]; returns all 1
    inp = single([1.0], [[1, 1, 1]], values=[[0.5, 0.2, 0.4]])
    out = compute_advantages(inp, AdvantageSettings(estimator="gae"))
    torch.testing.assert_close(out.advantages, torch.tensor([[0.5, 0.8, 0.6]], dtype=torch.float64))
    torch.testing.assert_close(out.returns, torch.ones(1, 3, dtype=torch.float64))


def test_gae_hole_skips_masked_token():
    # mask [1, 0, 1], V = [0.5, 9 (masked), 0.4], reward 1, gamma 0.9, lam 0.8:
    # A_2 = 1 - 0.4 = 0.6; delta_0 = 0 + 0.9 * 0.4 - 0.5 = -0.14; A_0 = -0.14 + 0.72 * 0.6 = 0.292
    inp = single([1.0], [[1, 0, 1]], values=[[0.5, 9.0, 0.4]])
    out = compute_advantages(inp, AdvantageSettings(estimator="gae", gamma=0.9, lam=0.8))
    torch.testing.assert_close(
        out.advantages, torch.tensor([[0.292, 0.0, 0.6]], dtype=torch.float64)
    )


@pytest.mark.parametrize(
    "seed,gamma,lam,coef,holes", [(0, 1.0, 1.0, 0.0, False), (1, 0.99, 0.95, 0.1, True)]
)
def test_gae_matches_loop_reference(seed, gamma, lam, coef, holes):
    inp = make_batch(seed, num_groups=2, group_size=5, max_len=8, holes=holes)
    s = AdvantageSettings(estimator="gae", gamma=gamma, lam=lam, kl_in_reward_coef=coef)
    out = compute_advantages(inp, s)
    adv, ret = gae_ref(inp, s)
    torch.testing.assert_close(out.advantages, adv)
    torch.testing.assert_close(out.returns, ret)
    raw = gae(without_token_rewards(inp), s)
    adv, ret = gae_ref(inp, s, use_token_rewards=False)
    torch.testing.assert_close(raw.advantages, adv)


def test_one_token_and_empty_rows():
    # sample 0: one token, V 0.25, reward 2 -> A = 2 - 0.25 = 1.75, returns 2
    # sample 1: empty response -> nothing, whatever its reward and values
    inp = single([2.0, 5.0], [[1, 0], [0, 0]], values=[[0.25, 1.0], [1.0, 1.0]])
    out = compute_advantages(inp, AdvantageSettings(estimator="gae"))
    torch.testing.assert_close(
        out.advantages, torch.tensor([[1.75, 0.0], [0.0, 0.0]], dtype=torch.float64)
    )
    torch.testing.assert_close(
        out.returns, torch.tensor([[2.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    )
    raw = reinforce_pp(inp, AdvantageSettings(estimator="reinforce_pp"))
    torch.testing.assert_close(
        raw.returns, torch.tensor([[2.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    )


def test_gae_without_values_is_refused():
    inp = single([1.0], [[1, 1]])
    with pytest.raises(LossInputError, match="values"):
        compute_advantages(inp, AdvantageSettings(estimator="gae"))


def test_kl_in_reward_without_ref_is_refused():
    inp = single([1.0], [[1, 1]], old_logprobs=[[-1.0, -1.0]])
    with pytest.raises(LossInputError, match="ref_logprobs"):
        compute_advantages(inp, AdvantageSettings(estimator="reinforce_pp", kl_in_reward_coef=0.1))


def test_values_with_grad_give_constant_advantages():
    values = torch.tensor([[0.5, 0.2]], dtype=torch.float64, requires_grad=True)
    inp = AdvantageInputs(
        rewards=torch.tensor([1.0], dtype=torch.float64),
        group_ids=torch.tensor([0]),
        response_mask=torch.ones(1, 2),
        values=values,
    )
    out = compute_advantages(inp, AdvantageSettings(estimator="gae"))
    assert not out.advantages.requires_grad and not out.returns.requires_grad
