"""The ``algorithm`` section (losses and advantages, with its ``kl_loss``, ``kl_in_reward`` and
``rollout_correction`` sub-sections) and the ``critic`` section."""

from __future__ import annotations

from typing import Literal

import attrs

from unirl.core.run.sections.training import OptimizerConfig
from unirl.core.run.validators import (
    non_negative,
    positive,
)

# The algorithm sections hold plain values: their names and bounds are checked once, by the
# loss and advantage settings they are turned into (`unirl.core.run.algorithm`).


@attrs.frozen(kw_only=True)
class KLConfig:
    coef: float = 0.0
    estimator: str = "low_var_kl"  # a name of `unirl.core.maths.kl.KL_ESTIMATORS`


@attrs.frozen(kw_only=True)
class RolloutCorrectionConfig:
    """Correction for the rollout engine's log-probs differing from the trainer's (TIS, IcePop)."""

    mode: str = "none"  # one of `unirl.core.maths.losses.ROLLOUT_CORRECTION_MODES`
    low: float = 0.5
    high: float = 2.0


@attrs.frozen(kw_only=True)
class AlgorithmConfig:
    policy_loss: str = "ppo_clip"
    advantage_estimator: str = "grpo"
    loss_aggregation: str = "token-mean"  # one of `unirl.core.maths.losses.AGGREGATION_MODES`
    # Dr.GRPO's constant for seq-mean-token-sum-norm; defaults to rollout.max_new_tokens.
    norm_length: int | None = attrs.field(default=None, validator=positive)
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    entropy_coef: float = 0.0
    kl_loss: KLConfig = attrs.field(factory=KLConfig)
    kl_in_reward: KLConfig = attrs.field(factory=lambda: KLConfig(estimator="k1"))
    rollout_correction: RolloutCorrectionConfig = attrs.field(factory=RolloutCorrectionConfig)
    gamma: float = 1.0
    lam: float = 1.0
    std_normalize: bool = True
    whiten_advantages: bool = False
    value_coef: float = 0.5
    value_clip: float | None = 0.2
    # On-policy distillation shaping: A -= coef * (logp_student - logp_teacher).
    distillation_coef: float = 0.0
    # Features that read the policy's log-probs before the first optimizer step.
    mismatch_metrics: bool = False
    # "package.module:function" called as hook(batch, *, rl_step) -> RolloutBatch on every
    # rollout before it is trained on (user code, like any plug-in; unirl/rollouts/postprocess.py).
    rollout_postprocess_hook: str | None = None


@attrs.frozen(kw_only=True)
class CriticConfig:
    """PPO's learned value function: a causal-LM backbone with a scalar head per token, trained in
    the same run beside the policy with its own optimizer and LR schedule; GAE reads its values
    (`unirl.core.critic`). The loss is the shared clipped value loss (``algorithm.value_clip``,
    weighted by ``algorithm.value_coef``)."""

    # None: on exactly when algorithm.advantage_estimator uses values (gae). false with gae takes
    # the values from the rollout (a file's per-token 'values').
    enabled: bool | None = None
    # A local Hugging Face folder: a causal LM (its backbone is taken, the head initialised) or a
    # saved critic (a run's hf_critic/). None: the policy's initial weights (model.path or
    # model.hf_config + model.init_seed), with the head initialised from model.init_seed.
    path: str | None = None
    optimizer: OptimizerConfig = attrs.field(factory=lambda: OptimizerConfig(lr=1e-5))
    # Samples per critic microbatch per rank; None: the policy's plan (batch.micro_batch_size or
    # batch.max_tokens_per_microbatch).
    micro_batch_size: int | None = attrs.field(default=None, validator=positive)
    # The critic's own ZeRO stage (DeepSpeed) / distributed optimizer (Megatron, 1); None: the
    # policy's parallel.zero_stage.
    zero_stage: Literal[0, 1, 2, 3] | None = None
    # RL steps at the start of the run that train only the critic (the policy waits for values
    # that mean something; its LR schedule counts only the steps it takes).
    warmup_steps: int = attrs.field(default=0, validator=non_negative)
