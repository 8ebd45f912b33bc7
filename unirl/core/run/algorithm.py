"""The algorithm section of the config, turned into the settings objects of the loss and
advantage libraries. The settings validate themselves and the config checks none of their rules
again: `UnirlConfig` builds both once when it is created, so a bad value still fails at load."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from unirl.core.errors import ConfigError
from unirl.core.maths.advantages import AdvantageSettings
from unirl.core.maths.logprob_spec import LogprobSpec
from unirl.core.maths.losses import LossSettings

if TYPE_CHECKING:
    from unirl.core.run.config import UnirlConfig


# Each settings field and the config key it is read from: the one place config meets settings.
# The settings classes validate (one source per rule); their errors are re-worded with these keys.
_LOSS_KEYS = {
    "policy_loss": "algorithm.policy_loss",
    "loss_aggregation": "algorithm.loss_aggregation",
    "clip_low": "algorithm.clip_low",
    "clip_high": "algorithm.clip_high",
    "dual_clip": "algorithm.dual_clip",
    "entropy_coef": "algorithm.entropy_coef",
    "kl_loss_coef": "algorithm.kl_loss.coef",
    "kl_loss_estimator": "algorithm.kl_loss.estimator",
    "rollout_correction": "algorithm.rollout_correction.mode",
    "rollout_correction_low": "algorithm.rollout_correction.low",
    "rollout_correction_high": "algorithm.rollout_correction.high",
    "value_coef": "algorithm.value_coef",
    "value_clip": "algorithm.value_clip",
}
_ADVANTAGE_KEYS = {
    "estimator": "algorithm.advantage_estimator",
    "gamma": "algorithm.gamma",
    "lam": "algorithm.lam",
    "std_normalize": "algorithm.std_normalize",
    "kl_in_reward_coef": "algorithm.kl_in_reward.coef",
    "kl_in_reward_estimator": "algorithm.kl_in_reward.estimator",
    "distillation_coef": "algorithm.distillation_coef",
    "whiten": "algorithm.whiten_advantages",
}

_Settings = TypeVar("_Settings")


def _read(cfg: UnirlConfig, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _from_config(cls: type[_Settings], keys: dict[str, str], cfg: UnirlConfig) -> _Settings:
    try:
        return cls(**{field: _read(cfg, key) for field, key in keys.items()})
    except ConfigError as exc:
        message = str(exc)
        for field in sorted(keys, key=len, reverse=True):  # rollout_correction_low first
            message = message.replace(f"{cls.__name__}.{field}", keys[field])
        raise ConfigError(message) from None


def loss_settings(cfg: UnirlConfig) -> LossSettings:
    """The loss settings of ``cfg.algorithm``; a bad value raises `ConfigError` with its key."""
    return _from_config(LossSettings, _LOSS_KEYS, cfg)


def advantage_settings(cfg: UnirlConfig) -> AdvantageSettings:
    """The advantage settings of ``cfg.algorithm``; a bad value raises `ConfigError` with its
    key."""
    return _from_config(AdvantageSettings, _ADVANTAGE_KEYS, cfg)


def needs_reference(cfg: UnirlConfig) -> bool:
    """The reference model runs for the KL loss, KL in the reward, and as the distillation
    teacher (on-policy distillation uses model.ref_path as its teacher)."""
    a = cfg.algorithm
    return a.kl_loss.coef > 0 or a.kl_in_reward.coef > 0 or a.distillation_coef > 0


def train_logprob_spec(cfg: UnirlConfig, vocab_size: int) -> LogprobSpec:
    entropy_in_loss = cfg.algorithm.entropy_coef != 0
    return LogprobSpec(
        temperature=cfg.rollout.temperature,
        vocab_size=vocab_size,
        with_entropy=True,  # entropy is always reported; its gradient only when it is in the loss
        entropy_grad=entropy_in_loss,
    )


def forward_logprob_spec(cfg: UnirlConfig, vocab_size: int) -> LogprobSpec:
    return LogprobSpec(temperature=cfg.rollout.temperature, vocab_size=vocab_size)
