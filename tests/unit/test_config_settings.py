"""The algorithm section and the loss / advantage settings share one source: the settings classes
own every default and rule, the config only declares which YAML key sets which settings field
(`unirl.core.config.sections.feeds`). A default config must give default settings, and a bad value
must be refused with the key the user wrote, not the settings field's name."""

from __future__ import annotations

import typing

import attrs
import pytest

from unirl.core.config.derived import advantage_settings, loss_settings
from unirl.core.config.run_config import AlgorithmConfig, KLInRewardConfig, config_from_dict
from unirl.core.config.sections.feeds import FEEDS, fed_fields
from unirl.core.errors import ConfigError
from unirl.core.maths.advantages import AdvantageSettings
from unirl.core.maths.losses import LossSettings

MINIMAL = {
    "model": {"hf_config": {"model_type": "llama", "num_hidden_layers": 2, "vocab_size": 32}},
    "batch": {"micro_batch_size": 4},
    "parallel": {"world_size": 1},
}


def with_algorithm(**algorithm):
    return {**MINIMAL, "algorithm": algorithm}


@pytest.mark.parametrize(
    "settings_cls, build", [(LossSettings, loss_settings), (AdvantageSettings, advantage_settings)]
)
def test_a_default_config_gives_the_settings_defaults(settings_cls, build):
    built = build(config_from_dict(MINIMAL))
    defaults = settings_cls()
    for field in attrs.fields(settings_cls):
        assert getattr(built, field.name) == getattr(defaults, field.name), field.name


def test_the_keys_and_the_settings_fields_they_set():
    """Each YAML key of the algorithm section -> its settings field, written out here by hand:
    the declarations must link exactly these (a key linked to the wrong field, or a settings
    field that lost its key, fails)."""
    assert fed_fields(AlgorithmConfig, LossSettings) == {
        "policy_loss": "policy_loss",
        "loss_aggregation": "loss_aggregation",
        "clip_low": "clip_low",
        "clip_high": "clip_high",
        "dual_clip": "dual_clip",
        "entropy_coef": "entropy_coef",
        "kl_loss_coef": "kl_loss.coef",
        "kl_loss_estimator": "kl_loss.estimator",
        "rollout_correction": "rollout_correction.mode",
        "rollout_correction_low": "rollout_correction.low",
        "rollout_correction_high": "rollout_correction.high",
        "value_coef": "value_coef",
        "value_clip": "value_clip",
        "decoupled": "decoupled",
        "decoupled_cap": "decoupled_cap",
        "decoupled_cap_mode": "decoupled_cap_mode",
        "dro_beta": "dro_beta",
        "stable_reinforce_kl_coef": "stable_reinforce_kl_coef",
    }
    assert fed_fields(AlgorithmConfig, AdvantageSettings) == {
        "estimator": "advantage_estimator",
        "gamma": "gamma",
        "lam": "lam",
        "std_normalize": "std_normalize",
        "kl_in_reward_coef": "kl_in_reward.coef",
        "kl_in_reward_estimator": "kl_in_reward.estimator",
        "distillation_coef": "distillation_coef",
        "whiten": "whiten_advantages",
    }


def _fed_config_fields(cls: type):
    hints = typing.get_type_hints(cls)
    for field in attrs.fields(cls):
        if FEEDS in field.metadata:
            yield cls, field, hints[field.name]
        elif attrs.has(hints[field.name]):
            yield from _fed_config_fields(hints[field.name])


def test_a_key_has_the_type_of_the_settings_field_it_sets():
    """The YAML converter checks the config field's type; it must be the settings field's, or a
    value could pass one and fail the other."""
    fields = list(_fed_config_fields(AlgorithmConfig))
    # 2 MoE router coefficients, 3 decoupled-PPO keys, DRO's beta, StableReinforce's KL weight
    assert len(fields) == 28
    for cls, field, hint in fields:
        settings_cls, name = field.metadata[FEEDS]
        want = typing.get_type_hints(settings_cls)[name]
        if (cls, field.name) == (AlgorithmConfig, "decoupled"):
            # the one key that takes more: 'auto', resolved to a bool before the settings exist
            # (AlgorithmConfig.loss_settings); the settings field keeps the bool
            want = bool | typing.Literal["auto"]
        assert hint == want, f"{cls.__name__}.{field.name}"


@pytest.mark.parametrize(
    "algorithm, message",
    [
        ({"clip_low": -0.5}, "algorithm.clip_low must be >= 0, got -0.5"),
        ({"clip_low": 1.5}, "algorithm.clip_low=1.5 makes the lower ratio bound"),
        ({"dual_clip": float("nan")}, "algorithm.dual_clip must be finite, got nan"),
        ({"kl_loss": {"coef": -1.0}}, "algorithm.kl_loss.coef must be >= 0, got -1.0"),
        ({"kl_loss": {"estimator": "k9"}}, "algorithm.kl_loss.estimator='k9' is not one of"),
        (
            {"kl_in_reward": {"coef": -0.1}},
            r"algorithm.kl_in_reward.coef must be >= 0 \(0 turns it off\), got -0.1",
        ),
        ({"gamma": 1.5}, r"algorithm.gamma must be in \[0, 1\], got 1.5"),
        (
            {"router_z_loss_coef": -1.0},
            r"algorithm.router_z_loss_coef=-1.0 must be a finite number >= 0",
        ),
        (
            {"rollout_correction": {"mode": "tis", "low": 1.5}},
            "algorithm.rollout_correction.low=1.5 / algorithm.rollout_correction.high=2.0 must "
            "satisfy low <= 1 <= high",
        ),
        ({"value_clip": 0.0}, "algorithm.value_clip=0 freezes the value function"),
        ({"distillation_coef": -2.0}, "algorithm.distillation_coef must be >= 0"),
    ],
)
def test_a_bad_value_is_refused_with_the_yaml_key(algorithm, message):
    with pytest.raises(ConfigError, match=message) as info:
        config_from_dict(with_algorithm(**algorithm))
    assert "Settings" not in str(info.value)


def test_the_settings_built_directly_name_their_own_fields():
    """Without a config (the loss library alone, `unirl.losses`), the same rule names the
    settings field."""
    with pytest.raises(ConfigError, match=r"^LossSettings.clip_low must be >= 0, got -0.5$"):
        LossSettings(clip_low=-0.5)
    with pytest.raises(
        ConfigError, match=r"^AdvantageSettings.kl_in_reward_coef must be >= 0 \(0 turns it off\)"
    ):
        AdvantageSettings(kl_in_reward_coef=-0.1)
    # A section built in Python names the key relative to the section, like every section.
    with pytest.raises(ConfigError, match=r"^kl_in_reward.coef must be >= 0"):
        AlgorithmConfig(kl_in_reward=KLInRewardConfig(coef=-0.1))


def test_a_value_from_the_yaml_reaches_the_settings():
    cfg = config_from_dict(
        with_algorithm(
            clip_high=0.28,
            kl_loss={"coef": 0.01},
            kl_in_reward={"estimator": "k2"},
            whiten_advantages=True,
            advantage_estimator="rloo",
        )
    )
    loss, advantage = loss_settings(cfg), advantage_settings(cfg)
    assert (loss.clip_high, loss.kl_loss_coef, loss.clip_low) == (0.28, 0.01, 0.2)
    assert (advantage.kl_in_reward_estimator, advantage.whiten) == ("k2", True)
    assert advantage.estimator == "rloo"
