"""The algorithm section of the config, turned into the settings objects of the loss and
advantage libraries (built once per run; both validate themselves)."""

from __future__ import annotations

from unirl.core.backend import LogprobSpec
from unirl.core.errors import ConfigError
from unirl.core.maths.advantages import AdvantageSettings
from unirl.core.maths.losses import LossSettings
from unirl.core.run.config import UnirlConfig


def loss_settings(cfg: UnirlConfig) -> LossSettings:
    a = cfg.algorithm
    try:
        return LossSettings(
            policy_loss=a.policy_loss,
            loss_aggregation=a.loss_aggregation,
            clip_low=a.clip_low,
            clip_high=a.clip_high,
            dual_clip=a.dual_clip,
            entropy_coef=a.entropy_coef,
            kl_loss_coef=a.kl_loss.coef,
            kl_loss_estimator=a.kl_loss.estimator,
            rollout_correction=a.rollout_correction.mode,
            rollout_correction_low=a.rollout_correction.low,
            rollout_correction_high=a.rollout_correction.high,
            value_coef=a.value_coef,
            value_clip=a.value_clip,
        )
    except (ConfigError, ValueError) as exc:
        raise ConfigError(f"algorithm: {exc}") from None


def advantage_settings(cfg: UnirlConfig) -> AdvantageSettings:
    a = cfg.algorithm
    try:
        return AdvantageSettings(
            estimator=a.advantage_estimator,
            gamma=a.gamma,
            lam=a.lam,
            std_normalize=a.std_normalize,
            kl_in_reward_coef=a.kl_in_reward.coef,
            kl_in_reward_estimator=a.kl_in_reward.estimator,
            distillation_coef=a.distillation_coef,
            whiten=a.whiten_advantages,
        )
    except (ConfigError, ValueError) as exc:
        raise ConfigError(f"algorithm: {exc}") from None


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
