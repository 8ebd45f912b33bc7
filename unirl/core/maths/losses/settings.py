"""What the loss computes: the policy loss, its clip bounds, the extra terms and their weights.

The one source of each default and each rule: the config's ``algorithm`` section declares its
keys on these fields (`unirl.core.config.sections.algorithm`) and builds this class, so every
impossible value is rejected here, at setup, with a `ConfigError` naming the field (the YAML key
when built from a config) — not deep in the training loop.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable
from typing import Any, Literal

import attrs

from unirl.core.errors import KeyedConfigError
from unirl.core.maths.kl import KL_ESTIMATORS
from unirl.core.maths.losses.registry import get_policy_loss

Aggregation = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]
RolloutCorrection = Literal["none", "tis", "icepop", "seq_mask"]
# The valid names, for validation and error messages (from the types, so they cannot drift).
AGGREGATION_MODES: tuple[str, ...] = typing.get_args(Aggregation)
ROLLOUT_CORRECTION_MODES: tuple[str, ...] = typing.get_args(RolloutCorrection)
# What decoupled PPO does to a token whose behaviour weight passes decoupled_cap.
DecoupledCapMode = Literal["truncate", "mask"]
DECOUPLED_CAP_MODES: tuple[str, ...] = typing.get_args(DecoupledCapMode)


def _key(field: str) -> str:
    """How an error names a field when the settings are built directly (the config re-keys it to
    the YAML key, `unirl.core.config.sections.algorithm`)."""
    return f"LossSettings.{field}"


def _error(render: Callable[[Callable[[str], str]], str]) -> KeyedConfigError:
    return KeyedConfigError(render, _key)


def _finite(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not math.isfinite(value):
        raise _error(lambda key: f"{key(attribute.name)} must be finite, got {value}")


def _non_negative(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    _finite(instance, attribute, value)
    if value is not None and value < 0:
        raise _error(lambda key: f"{key(attribute.name)} must be >= 0, got {value}")


def _one_of(choices: tuple[str, ...]):
    def check(instance: Any, attribute: attrs.Attribute, value: str) -> None:
        if value not in choices:
            raise _error(
                lambda key: f"{key(attribute.name)}={value!r} is not one of {list(choices)}"
            )

    return check


def _policy_loss_exists(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    get_policy_loss(value)


# Settings fields read by one built-in policy loss only: (field, the loss).
_READ_BY_ONE_LOSS = (("dro_beta", "dro"), ("stable_reinforce_kl_coef", "stable_reinforce"))


@attrs.frozen(kw_only=True)
class LossSettings:
    """Settings of `compute_loss`; defaults are PPO / GRPO with symmetric clip 0.2."""

    # A registered name (ppo_clip, gspo, cispo, dro, reinforce, stable_reinforce, sft) or
    # "package.module:function".
    policy_loss: str = attrs.field(default="ppo_clip", validator=_policy_loss_exists)
    loss_aggregation: Aggregation = attrs.field(
        default="token-mean", validator=_one_of(AGGREGATION_MODES)
    )
    # Ratio clip range [1 - clip_low, 1 + clip_high]; clip_high > clip_low is DAPO's clip-higher.
    clip_low: float = attrs.field(default=0.2, validator=_non_negative)
    clip_high: float = attrs.field(default=0.2, validator=_non_negative)
    # Dual-clip constant c > 1 (Ye et al. 2020): bounds the loss of negative advantages.
    dual_clip: float | None = attrs.field(default=None, validator=_finite)
    # DRO's quadratic penalty weight beta (policy_loss: dro): beta/2 (logp - old_logp)^2.
    dro_beta: float = attrs.field(default=0.0, validator=_non_negative)
    # StableReinforce's penalty weight (policy_loss: stable_reinforce): kl_coef * KL(sampler ||
    # learner), Schulman's k3 per token. Tinker documents the key (kl_coeff), not a default; 0
    # leaves REINFORCE on the sampled tokens.
    stable_reinforce_kl_coef: float = attrs.field(default=0.0, validator=_non_negative)
    entropy_coef: float = attrs.field(default=0.0, validator=_finite)
    kl_loss_coef: float = attrs.field(default=0.0, validator=_non_negative)
    kl_loss_estimator: str = attrs.field(
        default="low_var_kl", validator=_one_of(tuple(KL_ESTIMATORS))
    )
    rollout_correction: RolloutCorrection = attrs.field(
        default="none", validator=_one_of(ROLLOUT_CORRECTION_MODES)
    )
    rollout_correction_low: float = attrs.field(default=0.5, validator=_non_negative)
    rollout_correction_high: float = attrs.field(default=2.0, validator=_non_negative)
    # Decoupled PPO (AReaL): weight each token by exp(proximal - behaviour); past decoupled_cap
    # the weight is the cap ("truncate", Hilton et al.'s truncated weight) or 0 ("mask":
    # AReaL's code drops the token from the policy gradient, its count stays in the mean).
    decoupled: bool = False
    decoupled_cap: float = attrs.field(default=5.0, validator=_non_negative)
    decoupled_cap_mode: DecoupledCapMode = attrs.field(
        default="truncate", validator=_one_of(DECOUPLED_CAP_MODES)
    )
    value_coef: float = attrs.field(default=0.5, validator=_non_negative)
    value_clip: float | None = attrs.field(default=0.2, validator=_non_negative)

    def _check_loss_specific_keys(self) -> None:
        """A weight that only one built-in loss reads, set beside another built-in loss, would
        change nothing: refused (a custom loss may read any field, so it is let through)."""
        name = self.policy_loss
        for field, loss in _READ_BY_ONE_LOSS:
            value = getattr(self, field)
            if value != 0 and name != loss and ":" not in name:
                raise _error(
                    lambda key, f=field, v=value, lo=loss: (
                        f"{key(f)}={v} is read only by policy_loss {lo}, and "
                        f"{key('policy_loss')} is {name!r}: it would change nothing; set "
                        f"{key('policy_loss')}: {lo} or remove {key(f)}"
                    )
                )

    def __attrs_post_init__(self) -> None:
        if self.clip_low > 1.0:
            raise _error(
                lambda key: (
                    f"{key('clip_low')}={self.clip_low} makes the lower ratio bound "
                    f"1 - clip_low negative; use a value in [0, 1] (1.0 = no lower bound)"
                )
            )
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise _error(
                lambda key: (
                    f"{key('dual_clip')}={self.dual_clip} must be > 1 (typical: 3.0), "
                    "or None to turn dual clipping off"
                )
            )
        lo, hi = self.rollout_correction_low, self.rollout_correction_high
        if not lo <= 1.0 <= hi or lo == hi:
            raise _error(
                lambda key: (
                    f"{key('rollout_correction_low')}={lo} / "
                    f"{key('rollout_correction_high')}={hi} must satisfy low <= 1 <= high with "
                    "low < high (an on-policy token, ratio 1, must keep weight 1); typical: 0.5 "
                    "and 2.0"
                )
            )
        if self.decoupled_cap < 1.0:
            raise _error(
                lambda key: (
                    f"{key('decoupled_cap')}={self.decoupled_cap} must be >= 1 (an on-policy "
                    "token, ratio 1, must keep weight 1); typical: 5.0"
                )
            )
        if self.decoupled and self.rollout_correction != "none":
            raise _error(
                lambda key: (
                    f"{key('decoupled')}=True with {key('rollout_correction')}="
                    f"{self.rollout_correction!r} weights each token by the proximal / behaviour "
                    "ratio twice; decoupled PPO already corrects for the behaviour policy (the "
                    f"rollout engine), so set {key('rollout_correction')}: none or "
                    f"{key('decoupled')}: false"
                )
            )
        self._check_loss_specific_keys()
        if self.value_clip == 0:
            raise _error(
                lambda key: (
                    f"{key('value_clip')}=0 freezes the value function; use a positive "
                    "range (typical 0.2) or None for no value clipping"
                )
            )
