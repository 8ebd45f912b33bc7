"""Advantage settings: which estimator, its discounting, and the reward shaping around it.

The one source of each default and each rule: the config's ``algorithm`` section declares its
keys on these fields (`unirl.core.config.sections.algorithm`) and builds this class."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from unirl.core.errors import KeyedConfigError
from unirl.core.maths.advantages.registry import get_advantage_estimator
from unirl.core.maths.kl import KL_ESTIMATORS


def _key(field: str) -> str:
    """How an error names a field when the settings are built directly (the config re-keys it to
    the YAML key, `unirl.core.config.sections.algorithm`)."""
    return f"AdvantageSettings.{field}"


def _error(render: Callable[[Callable[[str], str]], str]) -> KeyedConfigError:
    return KeyedConfigError(render, _key)


def _unit_interval(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise _error(lambda key: f"{key(attribute.name)} must be in [0, 1], got {value}")


def _non_negative(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    if not value >= 0.0:  # also refuses NaN
        raise _error(
            lambda key: f"{key(attribute.name)} must be >= 0 (0 turns it off), got {value}"
        )


def _positive(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    if not value > 0.0:
        raise _error(lambda key: f"{key(attribute.name)} must be > 0, got {value}")


def _kl_estimator(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    if value not in KL_ESTIMATORS:
        raise _error(
            lambda key: (
                f"{key(attribute.name)}={value!r} is not a KL estimator; "
                f"valid: {sorted(KL_ESTIMATORS)}"
            )
        )


def _estimator(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    # Resolve now so that a typo or a broken "module:function" fails at setup, not mid-run.
    get_advantage_estimator(value)


@attrs.frozen(kw_only=True)
class AdvantageSettings:
    """How advantages are computed from one rollout.

    - ``estimator``: a registered name (``grpo``, ``dr_grpo``, ``rloo``, ``reinforce_pp``,
      ``reinforce_pp_baseline``, ``gae``) or ``"package.module:function"``.
    - ``gamma``, ``lam``: discount and GAE lambda (token-level estimators only).
    - ``std_normalize``: GRPO divides by the group std; False is Dr.GRPO.
    - ``epsilon``: added to the group std before dividing.
    - ``kl_in_reward_coef`` / ``kl_in_reward_estimator``: subtract ``coef * KL_t(old || ref)``
      from every token's reward (token-level estimators); 0 turns it off.
    - ``distillation_coef``: on-policy distillation, ``A_t -= coef * (logp_old_t - logp_teacher_t)``;
      0 turns it off.
    - ``whiten``: whiten the final advantages over the batch (all ranks of the group given to
      `compute_advantages`).
    """

    estimator: str = attrs.field(default="grpo", validator=_estimator)
    gamma: float = attrs.field(default=1.0, validator=_unit_interval)
    lam: float = attrs.field(default=1.0, validator=_unit_interval)
    std_normalize: bool = True
    epsilon: float = attrs.field(default=1e-6, validator=_positive)
    kl_in_reward_coef: float = attrs.field(default=0.0, validator=_non_negative)
    kl_in_reward_estimator: str = attrs.field(default="k1", validator=_kl_estimator)
    distillation_coef: float = attrs.field(default=0.0, validator=_non_negative)
    whiten: bool = False
