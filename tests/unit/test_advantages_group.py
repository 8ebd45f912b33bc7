"""GRPO, Dr.GRPO and RLOO against hand-computed cases and a per-sample Python loop."""

from __future__ import annotations

import math

import pytest
import torch

from unirl.core.errors import ConfigError, LossInputError
from unirl.core.maths.advantages import AdvantageInputs, AdvantageSettings, compute_advantages

EPS = 1e-6


def make_batch(seed: int, num_groups: int, group_size: int, max_len: int, holes: bool = False):
    """Random rewards, shuffled non-contiguous group ids, response lengths 0..max_len."""
    g = torch.Generator().manual_seed(seed)
    b = num_groups * group_size
    lengths = torch.randint(0, max_len + 1, (b,), generator=g)
    mask = torch.arange(max_len)[None, :] < lengths[:, None]
    if holes:
        mask &= torch.rand(b, max_len, generator=g) > 0.25
    rewards = torch.randn(b, generator=g, dtype=torch.float64)
    perm = torch.randperm(b, generator=g)
    group_ids = (torch.arange(b) // group_size)[perm] * 10 + 3
    return AdvantageInputs(rewards=rewards, group_ids=group_ids, response_mask=mask.long())


def loop_reference(inp: AdvantageInputs, estimator: str, eps: float = EPS) -> torch.Tensor:
    """Per-sample loop in Python floats."""
    r, gid, m = inp.rewards.tolist(), inp.group_ids.tolist(), inp.response_mask.tolist()
    out = []
    for i in range(len(r)):
        members = [r[j] for j in range(len(r)) if gid[j] == gid[i]]
        k = len(members)
        mean = sum(members) / k
        if estimator == "grpo":
            if k == 1:
                a = 0.0
            else:
                std = math.sqrt(sum((x - mean) ** 2 for x in members) / (k - 1))
                a = (r[i] - mean) / (std + eps)
        elif estimator == "dr_grpo":
            a = r[i] - mean
        elif estimator == "rloo":
            a = r[i] - (sum(members) - r[i]) / (k - 1)
        else:
            raise AssertionError(estimator)
        out.append([a if mt else 0.0 for mt in m[i]])
    return torch.tensor(out, dtype=torch.float64)


def run(inp: AdvantageInputs, **settings) -> torch.Tensor:
    return compute_advantages(inp, AdvantageSettings(**settings)).advantages


# -- hand-computed cases ---------------------------------------------------------------------


def one_group(rewards, mask=None):
    b = len(rewards)
    mask = torch.ones(b, 2, dtype=torch.long) if mask is None else mask
    return AdvantageInputs(
        rewards=torch.tensor(rewards, dtype=torch.float64),
        group_ids=torch.zeros(b, dtype=torch.long),
        response_mask=mask,
    )


def test_grpo_hand_computed():
    # rewards [1, 0, 0, 1]: mean 0.5, deviations ±0.5,
    # unbiased var = 4 * 0.25 / 3 = 1/3, std = 0.5773503, A = ±0.5 / (0.5773503 + 1e-6) = ±0.8660239
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [0, 1]])
    adv = run(one_group([1.0, 0.0, 0.0, 1.0], mask))
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert a == pytest.approx(0.8660239, abs=1e-6)
    expected = torch.tensor([[a, a], [-a, 0.0], [-a, -a], [0.0, a]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected)


def test_grpo_two_groups_interleaved_ids():
    # group 7: rewards [1, 2, 3] -> mean 2, unbiased var (1 + 0 + 1) / 2 = 1, A = [-1, 0, 1] / (1 + eps)
    # group 3: rewards [5, 5, 5] -> all equal, A = 0
    inp = AdvantageInputs(
        rewards=torch.tensor([1.0, 5.0, 2.0, 5.0, 3.0, 5.0]),
        group_ids=torch.tensor([7, 3, 7, 3, 7, 3]),
        response_mask=torch.ones(6, 1, dtype=torch.bool),
    )
    adv = run(inp)
    d = 1 / (1 + 1e-6)
    torch.testing.assert_close(adv[:, 0], torch.tensor([-d, 0.0, 0.0, 0.0, d, 0.0]))


def test_dr_grpo_hand_computed():
    # rewards [1, 0, 0, 1]: A = r - 0.5 = [0.5, -0.5, -0.5, 0.5], no std division
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5], dtype=torch.float64)[:, None].expand(4, 2)
    torch.testing.assert_close(run(one_group([1.0, 0.0, 0.0, 1.0]), estimator="dr_grpo"), expected)
    torch.testing.assert_close(
        run(one_group([1.0, 0.0, 0.0, 1.0]), estimator="grpo", std_normalize=False), expected
    )


def test_rloo_hand_computed():
    # rewards [1, 0, 0, 1], k = 4: A_0 = 1 - (0 + 0 + 1) / 3 = 2/3; A_1 = 0 - (1 + 0 + 1) / 3 = -2/3
    expected = torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3], dtype=torch.float64)
    torch.testing.assert_close(
        run(one_group([1.0, 0.0, 0.0, 1.0]), estimator="rloo"), expected[:, None].expand(4, 2)
    )
    # rewards [3, 1], k = 2: A = [3 - 1, 1 - 3] = [2, -2]
    torch.testing.assert_close(
        run(one_group([3.0, 1.0]), estimator="rloo")[:, 0],
        torch.tensor([2.0, -2.0], dtype=torch.float64),
    )


def test_returns_are_the_outcome_reward_on_valid_tokens():
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [0, 0]])
    out = compute_advantages(one_group([1.0, 0.0, 2.0, 3.0], mask), AdvantageSettings())
    expected = torch.tensor([[1.0, 1.0], [0.0, 0.0], [2.0, 2.0], [0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(out.returns, expected)


# -- random batches against the loop reference -----------------------------------------------


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("seed,num_groups,group_size,holes", [(0, 3, 4, False), (1, 5, 2, True)])
def test_matches_loop_reference(estimator, seed, num_groups, group_size, holes):
    inp = make_batch(seed, num_groups, group_size, max_len=7, holes=holes)
    torch.testing.assert_close(run(inp, estimator=estimator), loop_reference(inp, estimator))


def test_fp32_and_bool_mask():
    inp = make_batch(2, 4, 4, max_len=5)
    inp32 = AdvantageInputs(
        rewards=inp.rewards.float(),
        group_ids=inp.group_ids,
        response_mask=inp.response_mask.bool(),
    )
    adv = run(inp32)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv.double(), loop_reference(inp, "grpo"), rtol=1e-5, atol=1e-5)


def test_bf16_rewards_computed_in_fp32():
    # rewards [1, 0]: mean 0.5, unbiased std sqrt(0.5) = 0.70711, A = ±0.5 / 0.70711 = ±0.70711
    inp = AdvantageInputs(
        rewards=torch.tensor([1.0, 0.0], dtype=torch.bfloat16),
        group_ids=torch.tensor([0, 0]),
        response_mask=torch.ones(2, 1),
    )
    adv = run(inp)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.70711, -0.70711]), atol=1e-4, rtol=0)


# -- edge cases ------------------------------------------------------------------------------


def test_group_of_one_is_zero():
    # each sample its own group: A = r - r = 0 (no std) for grpo and dr_grpo
    inp = AdvantageInputs(
        rewards=torch.tensor([3.0, -1.0, 0.5]),
        group_ids=torch.tensor([0, 1, 2]),
        response_mask=torch.ones(3, 4),
    )
    for estimator in ("grpo", "dr_grpo"):
        adv = run(inp, estimator=estimator)
        assert torch.equal(adv, torch.zeros(3, 4))


def test_rloo_group_of_one_refused():
    inp = AdvantageInputs(
        rewards=torch.tensor([3.0, -1.0]),
        group_ids=torch.tensor([0, 1]),
        response_mask=torch.ones(2, 4),
    )
    with pytest.raises(LossInputError, match="rloo needs at least 2 samples per group"):
        run(inp, estimator="rloo")


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_all_equal_rewards_give_zeros_not_nan(estimator):
    inp = AdvantageInputs(
        rewards=torch.full((4,), 0.1),
        group_ids=torch.zeros(4, dtype=torch.long),
        response_mask=torch.ones(4, 3),
    )
    adv = run(inp, estimator=estimator)
    assert torch.isfinite(adv).all()
    torch.testing.assert_close(adv, torch.zeros(4, 3), atol=1e-6, rtol=0)


def test_one_token_and_empty_rows():
    # rewards [2, 0] in one group: mean 1, unbiased std sqrt(2), A = ±1 / (sqrt(2) + eps).
    # Sample 1 has an empty response: its reward still counts in the group, but it gets no tokens.
    inp = AdvantageInputs(
        rewards=torch.tensor([2.0, 0.0], dtype=torch.float64),
        group_ids=torch.tensor([0, 0]),
        response_mask=torch.tensor([[1, 0, 0], [0, 0, 0]]),
    )
    a = 1 / (math.sqrt(2) + 1e-6)
    expected = torch.tensor([[a, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(run(inp), expected)


def test_padding_garbage_is_ignored():
    # NaN log-probs on padding tokens must not leak into anything.
    inp = one_group([1.0, 0.0], torch.tensor([[1, 0], [1, 1]]))
    old = torch.tensor([[-0.5, float("nan")], [-0.1, -0.2]], dtype=torch.float64)
    inp = AdvantageInputs(
        rewards=inp.rewards,
        group_ids=inp.group_ids,
        response_mask=inp.response_mask,
        old_logprobs=old,
        teacher_logprobs=torch.zeros(2, 2, dtype=torch.float64),
    )
    adv = run(inp, estimator="dr_grpo", distillation_coef=1.0)
    # A = [0.5, -0.5]; distillation: A_t - (old_t - 0): [[0.5 + 0.5, 0], [-0.5 + 0.1, -0.5 + 0.2]]
    expected = torch.tensor([[1.0, 0.0], [-0.4, -0.3]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected)


# -- refusals --------------------------------------------------------------------------------


def test_token_rewards_refused_by_sequence_estimators():
    inp = one_group([1.0, 0.0])
    inp = AdvantageInputs(
        rewards=inp.rewards,
        group_ids=inp.group_ids,
        response_mask=inp.response_mask,
        token_rewards=torch.zeros(2, 2, dtype=torch.float64),
    )
    for estimator in ("grpo", "rloo"):
        with pytest.raises(LossInputError, match="token_rewards"):
            run(inp, estimator=estimator)


def test_kl_in_reward_refused_by_sequence_estimators():
    with pytest.raises(ConfigError, match="kl_in_reward_coef"):
        run(one_group([1.0, 0.0]), estimator="grpo", kl_in_reward_coef=0.1)
