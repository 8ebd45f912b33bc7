"""The old-log-prob decision as a table, and as a property over random feature combinations."""

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.replay_fixtures import MOE_HF, REPLAY_BACKEND, replay_backend
from unirl.core.config.run_config import config_from_dict
from unirl.core.data.rollout import RolloutBatch
from unirl.core.data.sample import RolloutSample
from unirl.core.errors import ConfigError
from unirl.core.old_logprobs import (
    DecisionLog,
    decide_old_logprobs,
    logprob_roles,
    registered_needs,
    rollout_staleness,
    uncorrected_staleness,
)

# 8 prompts x 4 samples = 32 per rollout; one optimizer step of 32 by default.
BASE = {
    "model": {"hf_config": {"model_type": "llama"}},
    "batch": {
        "prompts_per_rollout": 8,
        "samples_per_prompt": 4,
        "samples_per_optimizer_step": 32,
        "micro_batch_size": 4,
    },
    "parallel": {"world_size": 1},
}


def make(mode="auto", **overrides):
    data = {k: dict(v) for k, v in BASE.items()}
    data["old_logprobs"] = mode
    for dotted, value in overrides.items():
        if "__" not in dotted:  # a top-level key (backend)
            data[dotted] = value
            continue
        if dotted == "model__hf_config":
            data["model"] = {"hf_config": value}
            continue
        section, key = dotted.split("__", 1)
        node = data.setdefault(section, {})
        if "__" in key:
            sub, leaf = key.split("__")
            node.setdefault(sub, {})[leaf] = value
        else:
            node[key] = value
    return config_from_dict(data)


TWO_STEPS = {"batch__samples_per_optimizer_step": 16}
TWO_EPOCHS = {"batch__epochs_per_rollout": 2}
KL_REWARD = {"algorithm__kl_in_reward__coef": 0.05}
DISTILL = {"algorithm__distillation_coef": 0.5}
MISMATCH = {"algorithm__mismatch_metrics": True}
# The hook runs before any policy log-prob exists: it declares no need (reuse stays valid).
HOOK = {"algorithm__rollout_postprocess_hook": "mypkg.hooks:filter"}
GAE = {"algorithm__advantage_estimator": "gae"}
CUSTOM_LOSS = {"algorithm__policy_loss": "tests.unit.custom_components:undeclared_loss"}
CUSTOM_LOSS_OK = {"algorithm__policy_loss": "tests.unit.custom_components:reuse_safe_loss"}
CUSTOM_EST = {"algorithm__advantage_estimator": "tests.unit.custom_components:undeclared_estimator"}
CUSTOM_EST_OK = {
    "algorithm__advantage_estimator": "tests.unit.custom_components:reuse_safe_estimator"
}
KL_LOSS = {"algorithm__kl_loss__coef": 0.01}  # KL *loss* uses ref log-probs, not old ones
TIS = {"algorithm__rollout_correction__mode": "tis"}
ENTROPY = {"algorithm__entropy_coef": 0.01}
# Routing replay on a tiny Qwen3-MoE: R2 records in the old-log-prob forward (a need); R3 replays
# the engine's experts from the data (no need: reuse stays valid).
_MOE = {"backend": REPLAY_BACKEND, "model__hf_config": MOE_HF}
RECORD = {**_MOE, "algorithm__routing_replay": "record"}
# (from a file of finished rollouts: the sampler records no experts and refuses R3)
R3 = {
    **_MOE,
    "algorithm__routing_replay": "rollout",
    "rollout__source": "file",
    "rollout__file": "r3.jsonl",
}


@pytest.fixture(autouse=True)
def _replay_backend():
    with replay_backend():
        yield


TABLE = [
    # (mode, overrides, expected source, expected active needs)
    ("auto", {}, "reuse", set()),
    ("auto", TWO_STEPS, "recompute", {"multiple_optimizer_steps"}),
    ("auto", TWO_EPOCHS, "recompute", {"multiple_optimizer_steps"}),
    ("auto", KL_REWARD, "recompute", {"kl_in_reward"}),
    ("auto", DISTILL, "recompute", {"distillation_shaping"}),
    ("auto", MISMATCH, "recompute", {"mismatch_metrics"}),
    ("auto", HOOK, "reuse", set()),
    ("auto", GAE, "recompute", {"value_estimator"}),
    ("auto", CUSTOM_LOSS, "recompute", {"policy_loss"}),
    ("auto", CUSTOM_LOSS_OK, "reuse", set()),
    ("auto", CUSTOM_EST, "recompute", {"advantage_estimator"}),
    ("auto", CUSTOM_EST_OK, "reuse", set()),
    ("auto", KL_LOSS, "reuse", set()),
    ("auto", TIS, "reuse", set()),
    ("auto", ENTROPY, "reuse", set()),
    ("auto", {"algorithm__advantage_estimator": "rloo"}, "reuse", set()),
    ("auto", {"algorithm__policy_loss": "gspo"}, "reuse", set()),
    ("auto", {"algorithm__policy_loss": "cispo", **KL_LOSS}, "reuse", set()),
    (
        "auto",
        {**TWO_STEPS, **KL_REWARD, **MISMATCH},
        "recompute",
        {"multiple_optimizer_steps", "kl_in_reward", "mismatch_metrics"},
    ),
    ("auto", RECORD, "recompute", {"routing_replay"}),
    ("auto", R3, "reuse", set()),
    ("auto", {**R3, **TWO_STEPS}, "recompute", {"multiple_optimizer_steps"}),
    ("auto", {**RECORD, **TWO_STEPS}, "recompute", {"routing_replay", "multiple_optimizer_steps"}),
    ("auto", _MOE, "reuse", set()),
    ("recompute", RECORD, "recompute", {"routing_replay"}),
    ("rollout", R3, "rollout", set()),
    ("reuse", R3, "reuse", set()),
    ("recompute", {}, "recompute", set()),
    ("recompute", TWO_STEPS, "recompute", {"multiple_optimizer_steps"}),
    ("reuse", {}, "reuse", set()),
    ("reuse", {**KL_LOSS, **ENTROPY, **TIS}, "reuse", set()),
    ("rollout", {}, "rollout", set()),
    ("rollout", TWO_STEPS, "rollout", {"multiple_optimizer_steps"}),
    ("rollout", {**DISTILL, **MISMATCH}, "rollout", {"distillation_shaping", "mismatch_metrics"}),
]


@pytest.mark.parametrize("mode, overrides, source, needs", TABLE)
def test_decision_table(mode, overrides, source, needs):
    decision = decide_old_logprobs(make(mode, **overrides))
    assert decision.source == source
    assert {n.feature for n in decision.needs} == needs
    assert decision.requested == mode
    text = decision.explain()
    for feature in needs:
        assert feature in text


@pytest.mark.parametrize(
    "overrides, feature",
    [
        (TWO_STEPS, "multiple_optimizer_steps"),
        (KL_REWARD, "kl_in_reward"),
        (GAE, "value_estimator"),
        (CUSTOM_LOSS, "policy_loss"),
        (RECORD, "routing_replay"),
    ],
)
def test_forced_reuse_with_a_need_is_a_config_error(overrides, feature):
    with pytest.raises(ConfigError, match=f"old_logprobs: reuse is invalid.*{feature}"):
        decide_old_logprobs(make("reuse", **overrides))


def test_rollout_size_changes_the_decision():
    cfg = make("auto")  # 32 samples per optimizer step
    assert decide_old_logprobs(cfg).source == "reuse"
    assert decide_old_logprobs(cfg, rollout_samples=64).source == "recompute"  # 2 steps
    assert decide_old_logprobs(cfg, rollout_samples=20).source == "reuse"  # one short step


def test_decision_logged_once_and_again_on_change(caplog):
    cfg = make("auto")
    log = DecisionLog()
    with caplog.at_level(logging.INFO, logger="unirl.core.old_logprobs"):
        assert log.update(decide_old_logprobs(cfg))
        assert not log.update(decide_old_logprobs(cfg))
        assert log.update(decide_old_logprobs(cfg, rollout_samples=64))
        assert not log.update(decide_old_logprobs(cfg, rollout_samples=64))
    assert len(caplog.records) == 2
    assert "changed:" in caplog.records[1].getMessage()
    assert "multiple_optimizer_steps" in caplog.records[1].getMessage()


FEATURES = {
    "steps": TWO_STEPS,
    "epochs": TWO_EPOCHS,
    "kl_reward": KL_REWARD,
    "distill": DISTILL,
    "mismatch": MISMATCH,
    "hook": HOOK,
    "gae": GAE,
    "custom_loss": CUSTOM_LOSS,
    "custom_est": CUSTOM_EST,
    "kl_loss": KL_LOSS,
    "tis": TIS,
    "entropy": ENTROPY,
    "record": RECORD,
    "r3": R3,
}
# Which features, by their definition, read the policy's log-probs before the first step.
NEEDY = {
    "steps",
    "epochs",
    "kl_reward",
    "distill",
    "mismatch",
    "gae",
    "custom_loss",
    "custom_est",
    "record",
}


@settings(max_examples=80, deadline=None)
@given(
    chosen=st.sets(st.sampled_from(sorted(FEATURES))),
    mode=st.sampled_from(["auto", "recompute", "reuse", "rollout"]),
)
def test_reuse_never_chosen_while_a_need_is_active(chosen, mode):
    if mode == "rollout":
        chosen = chosen - {"tis"}  # a config error of its own (corrects nothing)
    if {"record", "r3"} <= chosen:
        chosen = chosen - {"r3"}  # one routing_replay value
    if mode == "rollout":
        chosen = chosen - {"record"}  # a config error of its own (nothing would record)
    if {"gae", "custom_est"} <= chosen:
        chosen = chosen - {"custom_est"}
    overrides = {}
    for name in sorted(chosen):
        overrides.update(FEATURES[name])
    cfg = make(mode, **overrides)
    needy = bool(chosen & NEEDY)
    if mode == "reuse" and needy:
        with pytest.raises(ConfigError):
            decide_old_logprobs(cfg)
        return
    decision = decide_old_logprobs(cfg)
    assert bool(decision.needs) == needy
    if mode == "auto":
        assert decision.source == ("recompute" if needy else "reuse")
    else:
        assert decision.source == mode


def test_every_need_is_exercised_by_the_table():
    seen = {feature for *_, needs in TABLE + STALE_TABLE for feature in needs}
    assert seen == set(registered_needs())


# -- staleness: samples older than the policy at the training forward ----------------------------

DECOUPLED = {"algorithm__decoupled": True}
STALE_TABLE = [
    # (mode, overrides, staleness, expected source, expected active needs)
    ("auto", {}, 0, "reuse", set()),
    ("auto", {}, 1, "recompute", {"stale_samples"}),
    ("auto", {}, 3, "recompute", {"stale_samples"}),
    ("auto", DECOUPLED, 0, "reuse", set()),  # k = 0 with decoupled: the ratio is 1, reuse stays
    ("auto", DECOUPLED, 2, "recompute", {"stale_samples"}),
    ("auto", TWO_STEPS, 1, "recompute", {"stale_samples", "multiple_optimizer_steps"}),
    ("recompute", {}, 1, "recompute", {"stale_samples"}),
    ("rollout", {}, 1, "rollout", {"stale_samples"}),
]


@pytest.mark.parametrize("mode, overrides, staleness, source, needs", STALE_TABLE)
def test_staleness_rows(mode, overrides, staleness, source, needs):
    decision = decide_old_logprobs(make(mode, **overrides), staleness=staleness)
    assert decision.source == source
    assert {n.feature for n in decision.needs} == needs
    if staleness:
        assert f"up to {staleness} policy version(s) older" in decision.explain()


def test_forced_reuse_on_stale_samples_is_a_config_error():
    with pytest.raises(ConfigError, match=r"old_logprobs: reuse is invalid.*stale_samples"):
        decide_old_logprobs(make("reuse"), staleness=1)


def _batch(versions):
    samples = [
        RolloutSample(prompt_tokens=[1], response_tokens=[2], reward=0.0, group_id=i // 4,
                      policy_version=v)
        for i, v in enumerate(versions)
    ]  # fmt: skip
    return RolloutBatch(samples)


def test_rollout_staleness_is_the_oldest_sample_against_the_trainer():
    assert rollout_staleness(_batch([5, 4, 5, 3]), 5) == 2  # 5 - min(5, 4, 5, 3)
    assert rollout_staleness(_batch([5, 5, 5, 5]), 5) == 0
    assert rollout_staleness(_batch([None] * 4), 5) == 0  # a file without versions
    assert rollout_staleness(_batch([5, None, 2, None]), 5) == 3
    assert rollout_staleness(_batch([5] * 4), None) == 0  # a caller without a version


# -- algorithm.decoupled: auto (the default) resolved per rollout --------------------------------

K1 = {"train__max_staleness": 1}
FORCED_OFF = {"algorithm__decoupled": False}
SR = {"algorithm__policy_loss": "stable_reinforce"}
DECOUPLED_TABLE = [
    # (mode, overrides, staleness, has rollout_logprobs, decoupled on, words of the reason)
    ("auto", {}, 0, True, False, "auto: on-policy data"),  # k = 0: as before, number for number
    ("recompute", {}, 0, True, False, "auto: on-policy data"),
    ("auto", K1, 0, True, True, "auto: train.max_staleness=1"),  # k > 0: from the first rollout
    ("auto", K1, 1, True, True, "auto: train.max_staleness=1"),
    ("auto", {}, 2, True, True, "auto: samples up to 2 version(s) stale"),  # a stale file
    ("auto", {}, 2, False, False, "auto: the rollout has no rollout_logprobs"),
    ("auto", {**K1, **TIS}, 1, True, False, "auto: algorithm.rollout_correction.mode=tis"),
    ("rollout", K1, 1, True, False, "auto: old_logprobs: rollout makes proximal = behaviour"),
    ("auto", DECOUPLED, 0, True, True, "algorithm.decoupled: true"),  # forced, even on-policy
    ("auto", {**K1, **FORCED_OFF}, 1, True, False, "algorithm.decoupled: false"),
    # stable_reinforce measures the learner against the behaviour log-probs itself: an importance
    # weight on its advantage term is what it is built to leave out
    ("auto", {**K1, **SR}, 1, True, False, "auto: algorithm.policy_loss=stable_reinforce reads"),
    ("auto", {**K1, **SR}, 1, False, False, "auto: the rollout has no rollout_logprobs"),
    ("auto", {**SR, **DECOUPLED}, 1, True, True, "algorithm.decoupled: true"),  # forced wins
]


@pytest.mark.parametrize("mode, overrides, staleness, behaviour, on, why", DECOUPLED_TABLE)
def test_decoupled_rows(mode, overrides, staleness, behaviour, on, why):
    decision = decide_old_logprobs(
        make(mode, **overrides), staleness=staleness, has_behaviour=behaviour
    )
    assert decision.decoupled.on is on
    assert decision.decoupled.reason.startswith(why)
    assert f"decoupled PPO: {'on' if on else 'off'} ({why}" in decision.explain()
    assert decision.to_dict()["decoupled"] == {"on": on, "reason": decision.decoupled.reason}


def test_decoupled_auto_sets_the_loss_weight_only_when_on():
    """The k = 0 loss settings are those of a config that never heard of decoupled PPO."""
    assert (
        make("auto").algorithm.loss_settings()
        == make("auto", **FORCED_OFF).algorithm.loss_settings()
    )
    assert make("auto").algorithm.loss_settings(decoupled=True).decoupled is True
    assert make("auto", **FORCED_OFF).algorithm.loss_settings(decoupled=True).decoupled is False
    assert make("auto", **DECOUPLED).algorithm.loss_settings(decoupled=False).decoupled is True


@pytest.mark.parametrize(
    "overrides, staleness, behaviour, warns, fix",
    [
        ({}, 0, True, False, None),
        ({}, 2, True, False, None),  # auto weights the stale tokens
        (FORCED_OFF, 2, True, True, "set algorithm.decoupled: true or auto"),
        ({}, 2, False, True, "give the rollout the engine's rollout_logprobs"),
        ({"old_logprobs": "rollout"}, 1, True, True, "use old_logprobs: auto or recompute"),
        (DECOUPLED, 2, True, False, None),
        (TIS, 2, True, False, None),
        ({"algorithm__rollout_correction__mode": "icepop"}, 1, True, False, None),
        (SR, 2, True, False, None),  # its own q is the behaviour log-prob
        (SR, 2, False, True, "give the rollout the engine's rollout_logprobs"),
    ],
)
def test_uncorrected_staleness_warning(overrides, staleness, behaviour, warns, fix):
    overrides = dict(overrides)  # the parameter's dict is shared between runs
    mode = overrides.pop("old_logprobs", "auto")
    warning = uncorrected_staleness(make(mode, **overrides), staleness, has_behaviour=behaviour)
    assert (warning is not None) == warns
    if warns:
        assert fix in warning
        assert f"up to {staleness} policy version(s) stale" in warning


def test_roles_say_where_each_log_prob_comes_from():
    roles = logprob_roles(make("auto"), decide_old_logprobs(make("auto")))
    assert roles["proximal"].startswith("the training forward's own, detached")
    assert "weights no token in this rollout (decoupled PPO: off (auto" in roles["behaviour"]
    cfg = make("auto", **DECOUPLED)
    roles = logprob_roles(cfg, decide_old_logprobs(cfg, staleness=1))
    assert roles["proximal"].startswith("a forward-only pass")
    assert (
        "weights the loss through decoupled PPO (algorithm.decoupled: true)" in roles["behaviour"]
    )
    cfg = make("auto", **K1, **SR)
    roles = logprob_roles(cfg, decide_old_logprobs(cfg, staleness=1))
    assert "weights the loss through algorithm.policy_loss=stable_reinforce" in roles["behaviour"]
    roles = logprob_roles(make("rollout"), decide_old_logprobs(make("rollout")))
    assert "behaviour = proximal" in roles["proximal"]
