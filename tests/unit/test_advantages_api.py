"""Input validation, settings, the estimator registry, `compute_advantages` ordering and local
masked whitening."""

from __future__ import annotations

import math
import statistics
import sys
import textwrap

import pytest
import torch

from unirl.core.errors import ConfigError, LossInputError
from unirl.core.maths.advantages import (
    AdvantageInputs,
    AdvantageSettings,
    apply_distillation,
    compute_advantages,
    estimator_needs_old_logprobs,
    estimator_needs_values,
    get_advantage_estimator,
    masked_whiten,
    register_advantage_estimator,
    registered_advantage_estimators,
)
from unirl.core.maths.advantages import registry as registry_module


def inputs(b=4, length=3, **overrides):
    fields = dict(
        rewards=torch.tensor([1.0, 0.0, 0.0, 1.0][:b]),
        group_ids=torch.zeros(b, dtype=torch.long),
        response_mask=torch.ones(b, length),
    )
    fields.update(overrides)
    return AdvantageInputs(**fields)


# -- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(rewards=torch.zeros(5)), r"rewards must be \[B\]=4"),
        (dict(rewards=torch.zeros(4, 3)), "rewards must be"),
        (dict(group_ids=torch.zeros(3, dtype=torch.long)), r"group_ids must be \[B\]=4"),
        (dict(group_ids=torch.zeros(4)), "group_ids must be an integer tensor"),
        (dict(response_mask=torch.ones(4)), r"response_mask must be \[B, L\]"),
        (dict(response_mask=torch.full((4, 3), 2.0)), "response_mask must hold only 0 and 1"),
        (dict(values=torch.zeros(4, 4)), r"values must be \[B, L\]=\(4, 3\)"),
        (dict(old_logprobs=torch.zeros(3, 3)), "old_logprobs must be"),
        (dict(rewards=torch.tensor([1, 0, 0, 1])), "rewards must be floating point"),
    ],
)
def test_shape_and_dtype_errors_name_the_argument(overrides, match):
    with pytest.raises(LossInputError, match=match):
        compute_advantages(inputs(**overrides), AdvantageSettings())


def test_nan_reward_names_the_sample():
    bad = torch.tensor([1.0, 0.0, float("nan"), float("inf")])
    with pytest.raises(LossInputError, match=r"rewards must be finite; samples \[2, 3\]"):
        compute_advantages(inputs(rewards=bad), AdvantageSettings())


def test_nan_on_valid_token_refused_but_allowed_on_padding():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]])
    old = torch.zeros(4, 3)
    old[1, 2] = float("nan")  # padding: fine
    teacher = torch.zeros(4, 3)
    s = AdvantageSettings(distillation_coef=0.1)
    compute_advantages(inputs(response_mask=mask, old_logprobs=old, teacher_logprobs=teacher), s)
    old[3, 1] = float("nan")  # a valid token of sample 3
    with pytest.raises(LossInputError, match=r"old_logprobs is not finite .* samples \[3\]"):
        compute_advantages(
            inputs(response_mask=mask, old_logprobs=old, teacher_logprobs=teacher), s
        )


@pytest.mark.parametrize(
    "group_ids",
    [
        torch.tensor([0, 0, 1, 1, 2]),  # group size 2 does not divide B = 5
        torch.tensor([0, 0, 0, 1, 1]),  # unequal sizes
    ],
)
def test_unequal_groups_refused_for_group_estimators(group_ids):
    inp = AdvantageInputs(
        rewards=torch.zeros(5), group_ids=group_ids, response_mask=torch.ones(5, 2)
    )
    for estimator in ("grpo", "rloo", "reinforce_pp_baseline"):
        with pytest.raises(LossInputError, match="group_ids: groups have unequal sizes"):
            compute_advantages(inp, AdvantageSettings(estimator=estimator))
    # estimators without groups do not care
    compute_advantages(inp, AdvantageSettings(estimator="reinforce_pp"))


def test_distillation_without_teacher_refused():
    with pytest.raises(LossInputError, match="teacher_logprobs"):
        compute_advantages(
            inputs(old_logprobs=torch.zeros(4, 3)), AdvantageSettings(distillation_coef=0.5)
        )


# -- settings --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(gamma=1.5), "gamma must be in"),
        (dict(lam=-0.1), "lam must be in"),
        (dict(epsilon=0.0), "epsilon must be > 0"),
        (dict(kl_in_reward_coef=-1.0), "kl_in_reward_coef must be >= 0"),
        (dict(distillation_coef=float("nan")), "distillation_coef must be >= 0"),
        (dict(kl_in_reward_estimator="k9"), "is not a KL estimator"),
        (
            dict(estimator="grp0"),
            r"advantage_estimator='grp0' is not a registered advantage estimator "
            r"\(did you mean 'grpo'\?\); valid: .*'grpo'",
        ),
    ],
)
def test_bad_settings_raise_config_error(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        AdvantageSettings(**kwargs)


# -- registry --------------------------------------------------------------------------------


@pytest.fixture
def isolated_registry(monkeypatch, tmp_path):
    """A private copy of the registry and a temporary import path for custom modules."""
    monkeypatch.syspath_prepend(str(tmp_path))
    created = []

    def write_module(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        created.append(name)
        return name

    with registry_module.ESTIMATORS.scoped():
        yield write_module
    for name in created:
        sys.modules.pop(name, None)


CUSTOM = """
    import torch
    from unirl.core.maths.advantages import AdvantageOutput, register_advantage_estimator

    def doubled(inp, settings):
        adv = 2.0 * inp.rewards[:, None] * inp.response_mask
        return AdvantageOutput(advantages=adv, returns=adv)

    @register_advantage_estimator("declared_custom", needs_old_logprobs=False)
    def declared(inp, settings):
        adv = -inp.rewards[:, None] * inp.response_mask
        return AdvantageOutput(advantages=adv, returns=adv)

    def wrong_shape(inp, settings):
        return AdvantageOutput(advantages=inp.rewards, returns=inp.rewards)

    def not_finite(inp, settings):
        adv = torch.full(inp.response_mask.shape, float("nan"))
        return AdvantageOutput(advantages=adv, returns=adv)
"""


def test_builtin_needs():
    assert set(registered_advantage_estimators()) >= {
        "grpo",
        "dr_grpo",
        "rloo",
        "reinforce_pp",
        "reinforce_pp_baseline",
        "gae",
    }
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"):
        assert not estimator_needs_old_logprobs(name)
        assert not estimator_needs_values(name)
    assert estimator_needs_old_logprobs("gae") and estimator_needs_values("gae")


def test_custom_estimator_by_module_path(isolated_registry):
    mod = isolated_registry("adv_custom_a", CUSTOM)
    s = AdvantageSettings(estimator=f"{mod}:doubled")
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out = compute_advantages(inputs(b=2, response_mask=mask), s)
    # rewards [1, 0] doubled on valid tokens
    torch.testing.assert_close(out.advantages, torch.tensor([[2.0, 2.0, 0.0], [0.0, 0.0, 0.0]]))
    # undeclared: assumed to need pre-step old log-probs (safe), not values
    assert estimator_needs_old_logprobs(f"{mod}:doubled") is True
    assert estimator_needs_values(f"{mod}:doubled") is False


def test_declared_custom_estimator_keeps_its_declarations(isolated_registry):
    mod = isolated_registry("adv_custom_b", CUSTOM)
    # by path: importing the module registers it, and the path finds its declarations
    assert estimator_needs_old_logprobs(f"{mod}:declared") is False
    assert estimator_needs_old_logprobs("declared_custom") is False
    out = compute_advantages(inputs(b=2), AdvantageSettings(estimator="declared_custom"))
    torch.testing.assert_close(out.advantages[:, 0], torch.tensor([-1.0, 0.0]))


def test_register_in_test(isolated_registry):
    @register_advantage_estimator("zeros_test", needs_values=True)
    def zeros(inp, settings):
        raise AssertionError("not called")

    assert estimator_needs_values("zeros_test") and not estimator_needs_old_logprobs("zeros_test")
    assert get_advantage_estimator("zeros_test").fn is zeros
    with pytest.raises(ConfigError, match="already registered"):

        @register_advantage_estimator("zeros_test")
        def other(inp, settings):
            raise AssertionError("not called")


def test_bad_custom_paths(isolated_registry):
    mod = isolated_registry("adv_custom_c", CUSTOM)
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module_xyz'"):
        get_advantage_estimator("no_such_module_xyz:fn")
    with pytest.raises(ConfigError, match="has no callable 'missing'"):
        get_advantage_estimator(f"{mod}:missing")
    with pytest.raises(LossInputError, match=r"returned advantages of shape \(2,\)"):
        compute_advantages(inputs(b=2), AdvantageSettings(estimator=f"{mod}:wrong_shape"))
    with pytest.raises(LossInputError, match="non-finite advantages"):
        compute_advantages(inputs(b=2), AdvantageSettings(estimator=f"{mod}:not_finite"))


# -- compute_advantages: shaping and whitening order ------------------------------------------


def test_distillation_hand_computed():
    # dr_grpo rewards [1, 0] -> A = [0.5, -0.5]; coef 0.5, student - teacher per token:
    # sample 0: [0.2, -0.4] -> [0.5 - 0.1, 0.5 + 0.2] = [0.4, 0.7]
    # sample 1: [1.0, pad]  -> [-0.5 - 0.5, 0]         = [-1.0, 0.0]
    inp = AdvantageInputs(
        rewards=torch.tensor([1.0, 0.0]),
        group_ids=torch.tensor([0, 0]),
        response_mask=torch.tensor([[1, 1], [1, 0]]),
        old_logprobs=torch.tensor([[-1.0, -1.4], [-0.5, 3.0]]),
        teacher_logprobs=torch.tensor([[-1.2, -1.0], [-1.5, 0.0]]),
    )
    out = compute_advantages(inp, AdvantageSettings(estimator="dr_grpo", distillation_coef=0.5))
    torch.testing.assert_close(out.advantages, torch.tensor([[0.4, 0.7], [-1.0, 0.0]]))
    # the function alone, with the padding entry left as it was
    shaped = apply_distillation(
        torch.tensor([[0.5, 0.5], [-0.5, 9.0]]),
        inp.old_logprobs,
        inp.teacher_logprobs,
        inp.response_mask,
        0.5,
    )
    torch.testing.assert_close(shaped, torch.tensor([[0.4, 0.7], [-1.0, 9.0]]))


def test_reinforce_pp_whitens_before_distillation_then_optional_whiten():
    # one sample, gamma 1, reward 1, 3 tokens: returns [1, 1, 1] whiten to [0, 0, 0] (no spread);
    # distillation coef 1 with student - teacher = [0.3, 0.0, -0.3] -> A = [-0.3, 0.0, 0.3].
    # If distillation ran first, whitening would give ±0.3 / sqrt(0.09) = ±1.
    inp = AdvantageInputs(
        rewards=torch.tensor([1.0], dtype=torch.float64),
        group_ids=torch.tensor([0]),
        response_mask=torch.ones(1, 3),
        old_logprobs=torch.tensor([[-0.7, -1.0, -1.3]], dtype=torch.float64),
        teacher_logprobs=torch.full((1, 3), -1.0, dtype=torch.float64),
    )
    s = AdvantageSettings(estimator="reinforce_pp", distillation_coef=1.0)
    out = compute_advantages(inp, s)
    torch.testing.assert_close(
        out.advantages, torch.tensor([[-0.3, 0.0, 0.3]], dtype=torch.float64), atol=1e-7, rtol=0
    )
    # then whiten=True: [-0.3, 0, 0.3] has mean 0, unbiased var 0.09 -> [-1, 0, 1]
    s = AdvantageSettings(estimator="reinforce_pp", distillation_coef=1.0, whiten=True)
    torch.testing.assert_close(
        compute_advantages(inp, s).advantages,
        torch.tensor([[-1.0, 0.0, 1.0]], dtype=torch.float64),
        atol=1e-6,
        rtol=0,
    )


def test_grpo_with_whiten():
    # rewards [3, 1] one group, masks [[1, 1], [1, 0]]: GRPO A = ±1 / (sqrt(2) + 1e-6) = ±a;
    # tokens [a, a, -a]; whitened with mean a/3 and the unbiased std of those three values.
    inp = AdvantageInputs(
        rewards=torch.tensor([3.0, 1.0], dtype=torch.float64),
        group_ids=torch.tensor([0, 0]),
        response_mask=torch.tensor([[1, 1], [1, 0]]),
    )
    a = 1 / (math.sqrt(2) + 1e-6)
    vals = [a, a, -a]
    mean, std = statistics.mean(vals), statistics.stdev(vals)
    w = [(v - mean) / math.sqrt(std**2 + 1e-8) for v in vals]
    out = compute_advantages(inp, AdvantageSettings(whiten=True))
    torch.testing.assert_close(
        out.advantages, torch.tensor([[w[0], w[1]], [w[2], 0.0]], dtype=torch.float64)
    )


# -- masked_whiten (local) -------------------------------------------------------------------


def test_masked_whiten_against_statistics():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, generator=g, dtype=torch.float64) * 3 + 2
    mask = torch.rand(5, 7, generator=g) > 0.4
    mask[2] = False  # an empty row
    vals = [x[i, t].item() for i in range(5) for t in range(7) if mask[i, t]]
    mean, var = statistics.mean(vals), statistics.variance(vals)
    expected = torch.zeros(5, 7, dtype=torch.float64)
    expected_keep = torch.zeros(5, 7, dtype=torch.float64)
    for i in range(5):
        for t in range(7):
            if mask[i, t]:
                expected[i, t] = (x[i, t].item() - mean) / math.sqrt(var + 1e-8)
                expected_keep[i, t] = expected[i, t] + mean
    torch.testing.assert_close(masked_whiten(x, mask), expected)
    torch.testing.assert_close(masked_whiten(x, mask, shift_mean=False), expected_keep)
    out32 = masked_whiten(x.float(), mask.long())
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32, expected.float())


def test_masked_whiten_degenerate():
    x = torch.tensor([[5.0, 1.0], [2.0, 3.0]])
    assert torch.equal(masked_whiten(x, torch.zeros(2, 2)), torch.zeros(2, 2))
    # a single valid entry has no spread: 0
    assert torch.equal(masked_whiten(x, torch.tensor([[0, 0], [0, 1]])), torch.zeros(2, 2))
