"""Bad inputs and settings raise errors that name the argument; an all-masked microbatch gives
loss 0 with zero gradient; the policy-loss registry resolves names and custom functions."""

from __future__ import annotations

import pytest
import torch

from unirl.core.data.counts import GlobalCounts
from unirl.core.errors import ConfigError, LossInputError
from unirl.core.maths.losses import (
    AGGREGATION_MODES,
    LossInputs,
    LossSettings,
    compute_loss,
    get_policy_loss,
    policy_loss_needs_old_logprobs,
    register_policy_loss,
    registered_policy_losses,
)
from unirl.core.maths.losses import registry as registry_module

POLICIES = ["ppo_clip", "gspo", "cispo", "dro", "reinforce", "stable_reinforce", "sft"]
COUNTS = GlobalCounts(tokens=4, sequences=2, norm_length=8)


def _inputs(n: int = 5, **overrides) -> LossInputs:
    # two sequences: tokens 0-2 and 3-4, all valid
    seq_ids = torch.tensor([0, 0, 0, 1, 1])[:n]
    fields = {
        "logprobs": torch.full((n,), -1.0, requires_grad=True),
        "advantages": torch.ones(n),
        "loss_mask": torch.ones(n, dtype=torch.bool),
        "seq_ids": seq_ids,
        "num_seqs": 2,
        "seq_token_counts": torch.tensor([3, 2]),
    }
    fields.update(overrides)
    return LossInputs(**fields)


@pytest.mark.parametrize(
    "field", ["advantages", "loss_mask", "old_logprobs", "rollout_logprobs", "entropy", "values"]
)
def test_shape_mismatch_names_the_argument(field):
    with pytest.raises(
        LossInputError, match=rf"LossInputs\.{field} has shape \(4,\), expected \(5,\)"
    ):
        _inputs(**{field: torch.zeros(4)}).validate()


@pytest.mark.parametrize("field", ["logprobs", "old_logprobs", "ref_logprobs", "advantages"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_names_the_argument_and_token(field, bad):
    t = torch.full((5,), -1.0)
    t[2] = bad
    inp = _inputs(**{field: t})
    with pytest.raises(LossInputError, match=rf"LossInputs\.{field} has 1 non-finite .* token 2"):
        inp.validate()
    with pytest.raises(LossInputError, match=rf"LossInputs\.{field}"):  # compute_loss checks too
        compute_loss(inp, COUNTS, LossSettings())


def test_bad_sequence_structure():
    with pytest.raises(LossInputError, match=r"seq_ids must lie in \[0, num_seqs=2\)"):
        _inputs(seq_ids=torch.tensor([0, 0, 1, 1, 2])).validate()
    with pytest.raises(LossInputError, match="seq_ids must be int64"):
        _inputs(seq_ids=torch.tensor([0, 0, 0, 1, 1], dtype=torch.int32)).validate()
    with pytest.raises(LossInputError, match=r"seq_token_counts has shape \(3,\)"):
        _inputs(seq_token_counts=torch.tensor([3, 2, 0])).validate()
    # a LOCAL count smaller than the valid tokens seen here: the global count was not passed
    with pytest.raises(LossInputError, match=r"seq_token_counts\[0\]=2 is smaller than the 3"):
        _inputs(seq_token_counts=torch.tensor([2, 2])).validate()
    with pytest.raises(LossInputError, match="flat floating tensor"):
        _inputs(logprobs=torch.zeros(5, 1)).validate()
    with pytest.raises(LossInputError, match="loss_mask must be bool or float"):
        _inputs(loss_mask=torch.ones(5, dtype=torch.long)).validate()


def test_missing_inputs_for_enabled_terms():
    with pytest.raises(LossInputError, match="rollout_logprobs"):
        compute_loss(_inputs(), COUNTS, LossSettings(rollout_correction="tis"))
    with pytest.raises(LossInputError, match="ref_logprobs"):
        compute_loss(_inputs(), COUNTS, LossSettings(kl_loss_coef=0.1))
    with pytest.raises(LossInputError, match=r"entropy_coef=0.01 needs LossInputs\.entropy"):
        compute_loss(_inputs(), COUNTS, LossSettings(entropy_coef=0.01))
    with pytest.raises(LossInputError, match="returns"):
        compute_loss(_inputs(values=torch.zeros(5)), COUNTS, LossSettings())
    with pytest.raises(LossInputError, match="norm_length"):
        compute_loss(
            _inputs(),
            GlobalCounts(tokens=5, sequences=2),
            LossSettings(loss_aggregation="seq-mean-token-sum-norm"),
        )


def test_entropy_not_touched_when_coef_is_zero():
    entropy = torch.rand(5, requires_grad=True)
    out = compute_loss(_inputs(entropy=entropy), COUNTS, LossSettings())
    assert out.loss.grad_fn is not None
    (grad,) = torch.autograd.grad(out.loss, entropy, allow_unused=True)
    assert grad is None  # not in the graph


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@pytest.mark.parametrize("policy", POLICIES)
def test_all_masked_microbatch_gives_zero_loss_and_gradient(policy, mode):
    logp = torch.tensor([-1.0, -2.0, -0.5, -3.0, -0.1], requires_grad=True)
    inp = _inputs(
        logprobs=logp,
        old_logprobs=torch.tensor([-1.5, -1.0, -0.5, -1.0, -0.2]),
        rollout_logprobs=torch.tensor([-1.0, -1.0, -0.1, -1.0, -3.0]),
        ref_logprobs=torch.tensor([-2.0, -1.0, -0.5, -1.0, -0.2]),
        advantages=torch.tensor([1.0, -2.0, 0.5, -1.0, 3.0]),
        loss_mask=torch.zeros(5),
        seq_token_counts=torch.tensor([0, 0]),
        entropy=torch.rand(5, requires_grad=True),
        values=torch.randn(5, requires_grad=True),
        returns=torch.randn(5),
    )
    settings = LossSettings(
        policy_loss=policy,
        loss_aggregation=mode,
        kl_loss_coef=0.1,
        entropy_coef=0.01,
        rollout_correction="seq_mask",
    )
    # a whole step without valid tokens: the counts are 0 (GlobalCounts guards the division)
    out = compute_loss(inp, GlobalCounts(tokens=0, sequences=0, norm_length=8), settings)
    assert out.loss.item() == 0.0
    grads = torch.autograd.grad(out.loss, [logp, inp.entropy, inp.values])
    for g in grads:
        assert torch.equal(g, torch.zeros(5))


# -- registry ---------------------------------------------------------------------------------


def half_reinforce(inp, counts, settings):
    """A custom loss without a needs_old_logprobs declaration: -A logp / 2."""
    return -0.5 * inp.advantages * inp.logprobs, {}


def test_builtin_names_and_declarations():
    # the losses unirl registers (test modules register their own in the same process)
    builtin = [
        n for n in registered_policy_losses() if get_policy_loss(n).__module__.startswith("unirl.")
    ]
    assert builtin == sorted(POLICIES)
    # built-ins are exact with reused log-probs on one on-policy step
    assert not policy_loss_needs_old_logprobs("ppo_clip")
    assert not policy_loss_needs_old_logprobs("gspo")
    assert not policy_loss_needs_old_logprobs("cispo")
    assert not policy_loss_needs_old_logprobs("dro")
    assert not policy_loss_needs_old_logprobs("reinforce")
    assert not policy_loss_needs_old_logprobs("stable_reinforce")
    assert not policy_loss_needs_old_logprobs("sft")


def test_unknown_name_lists_valid_ones():
    with pytest.raises(
        ConfigError,
        match=r"policy_loss='ppo' is not a registered policy loss.*'cispo', 'dro', 'gspo'",
    ):
        get_policy_loss("ppo")
    with pytest.raises(ConfigError, match="is not a registered policy loss"):
        LossSettings(policy_loss="ppo")


def test_custom_loss_by_module_path():
    spec = f"{__name__}:half_reinforce"
    assert get_policy_loss(spec) is half_reinforce
    assert policy_loss_needs_old_logprobs(spec)  # undeclared: assumed to need them
    logp = torch.tensor([-0.5, -1.0, -1.0, -2.0, -1.0], requires_grad=True)
    inp = _inputs(logprobs=logp, advantages=torch.tensor([2.0, 2.0, 0.0, 1.0, -1.0]))
    out = compute_loss(inp, GlobalCounts(tokens=5, sequences=2), LossSettings(policy_loss=spec))
    # -A logp / 2 = [0.5, 1.0, 0, 1.0, -0.5]; token-mean 2.0 / 5 = 0.4
    assert out.loss.item() == pytest.approx(0.4)


def already_averaged(inp, counts, settings):
    return (-inp.advantages * inp.logprobs).mean(), {}


def test_custom_loss_must_return_per_token_loss():
    settings = LossSettings(policy_loss=f"{__name__}:already_averaged")
    with pytest.raises(LossInputError, match=r"returned shape \(\); a policy loss returns"):
        compute_loss(_inputs(), COUNTS, settings)


def test_custom_loss_import_errors():
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module_xyz'"):
        get_policy_loss("no_such_module_xyz:fn")
    with pytest.raises(ConfigError, match="has no callable 'missing'"):
        get_policy_loss(f"{__name__}:missing")
    with pytest.raises(ConfigError, match=r"package\.module:function"):
        get_policy_loss(":fn")


def test_register_decorator():
    with registry_module.POLICY_LOSSES.scoped():

        @register_policy_loss("test_on_policy_only", needs_old_logprobs=False)
        def on_policy(inp, counts, settings):
            return -inp.advantages * inp.logprobs, {}

        assert get_policy_loss("test_on_policy_only") is on_policy
        assert not policy_loss_needs_old_logprobs("test_on_policy_only")
        with pytest.raises(ConfigError, match="already registered"):
            register_policy_loss("test_on_policy_only")(half_reinforce)
    assert "test_on_policy_only" not in registry_module.POLICY_LOSSES


# -- settings ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"loss_aggregation": "mean"}, "loss_aggregation='mean' is not one of"),
        ({"clip_low": -0.1}, "clip_low must be >= 0"),
        ({"clip_low": 1.5}, "clip_low=1.5 makes the lower ratio bound"),
        ({"clip_high": float("nan")}, "clip_high must be finite"),
        ({"dual_clip": 0.9}, "dual_clip=0.9 must be > 1"),
        ({"kl_loss_coef": -1.0}, "kl_loss_coef must be >= 0"),
        ({"kl_loss_estimator": "k4"}, "kl_loss_estimator='k4' is not one of"),
        ({"rollout_correction": "is"}, "rollout_correction='is' is not one of"),
        ({"rollout_correction_low": 1.2}, "low <= 1 <= high"),
        ({"rollout_correction_high": 0.9}, "low <= 1 <= high"),
        ({"entropy_coef": float("inf")}, "entropy_coef must be finite"),
        ({"value_coef": -0.5}, "value_coef must be >= 0"),
        ({"value_clip": 0.0}, "value_clip=0 freezes"),
    ],
)
def test_impossible_settings(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        LossSettings(**kwargs)


def test_default_settings_are_ppo():
    s = LossSettings()
    assert (s.policy_loss, s.loss_aggregation, s.clip_low, s.clip_high) == (
        "ppo_clip",
        "token-mean",
        0.2,
        0.2,
    )
