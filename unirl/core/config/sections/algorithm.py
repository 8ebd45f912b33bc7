"""The ``algorithm`` section (losses and advantages, with its ``kl_loss``, ``kl_in_reward`` and
``rollout_correction`` sub-sections) and the ``critic`` section."""

from __future__ import annotations

from typing import Literal

import attrs

from unirl.core.config.sections.feeds import FEEDS, Feeding, build_settings
from unirl.core.config.sections.training import OptimizerConfig
from unirl.core.config.validators import non_negative, positive
from unirl.core.maths.advantages.settings import AdvantageSettings
from unirl.core.maths.losses.router import RouterCoefficients
from unirl.core.maths.losses.settings import (
    Aggregation,
    DecoupledCapMode,
    LossSettings,
    RolloutCorrection,
)

# Mixture-of-experts routing replay (`unirl.core.routing_replay`): off; record (the old-log-prob
# forward records each MoE layer's top-k experts per token, the training forwards replay them);
# rollout (every trainer forward replays the experts the rollout engine used, from the data).
RoutingReplay = Literal["off", "record", "rollout"]

# The algorithm sections declare keys only: each default and each rule is the settings field's
# that the key sets (`unirl.core.config.sections.feeds`).
LOSS = Feeding(LossSettings)
ADVANTAGE = Feeding(AdvantageSettings)
ROUTER = Feeding(RouterCoefficients)


@attrs.frozen(kw_only=True)
class KLConfig:
    """The KL penalty in the loss (``algorithm.kl_loss``): ``coef * KL(policy || reference)``."""

    coef: float = LOSS.kl_loss_coef
    estimator: str = LOSS.kl_loss_estimator  # a name of `unirl.core.maths.kl.KL_ESTIMATORS`


@attrs.frozen(kw_only=True)
class KLInRewardConfig:
    """The KL penalty in the reward (``algorithm.kl_in_reward``), subtracted per token before the
    advantages are computed."""

    coef: float = ADVANTAGE.kl_in_reward_coef
    estimator: str = ADVANTAGE.kl_in_reward_estimator


@attrs.frozen(kw_only=True)
class RolloutCorrectionConfig:
    """Correction for the rollout engine's log-probs differing from the trainer's (TIS, IcePop)."""

    mode: RolloutCorrection = LOSS.rollout_correction
    low: float = LOSS.rollout_correction_low
    high: float = LOSS.rollout_correction_high


@attrs.frozen(kw_only=True)
class AlgorithmConfig:
    """The loss and the advantages. Built, it builds its `LossSettings` and `AdvantageSettings`
    once, so a bad value fails here with the key that set it."""

    policy_loss: str = LOSS.policy_loss
    advantage_estimator: str = ADVANTAGE.estimator
    loss_aggregation: Aggregation = LOSS.loss_aggregation
    # Dr.GRPO's constant for seq-mean-token-sum-norm; defaults to rollout.max_new_tokens.
    norm_length: int | None = attrs.field(default=None, validator=positive)
    clip_low: float = LOSS.clip_low
    clip_high: float = LOSS.clip_high
    dual_clip: float | None = LOSS.dual_clip
    # policy_loss: dro (Richemond et al.): the weight of its penalty beta/2 (logp - old_logp)^2
    dro_beta: float = LOSS.dro_beta
    # policy_loss: stable_reinforce: the weight of its penalty kl_coef * KL(sampler || learner)
    stable_reinforce_kl_coef: float = LOSS.stable_reinforce_kl_coef
    entropy_coef: float = LOSS.entropy_coef
    kl_loss: KLConfig = attrs.field(factory=KLConfig)
    kl_in_reward: KLInRewardConfig = attrs.field(factory=KLInRewardConfig)
    rollout_correction: RolloutCorrectionConfig = attrs.field(factory=RolloutCorrectionConfig)
    # Decoupled PPO (AReaL, unirl.core.maths.losses.decoupled): each token's loss weighted by
    # min(exp(proximal - behaviour), decoupled_cap), for stale (asynchronous) data. auto: on
    # exactly when samples can be stale (train.max_staleness > 0, or a rollout older than the
    # policy) and nothing else corrects for the behaviour policy, off for on-policy data
    # (`unirl.core.old_logprobs.decide_decoupled`; `unirl check` prints the choice); true /
    # false force it.
    decoupled: bool | Literal["auto"] = attrs.field(
        default="auto", metadata={FEEDS: (LossSettings, "decoupled")}
    )
    decoupled_cap: float = LOSS.decoupled_cap
    # truncate: min(w, cap); mask: w = 0 past the cap (AReaL's code); the token still counts
    decoupled_cap_mode: DecoupledCapMode = LOSS.decoupled_cap_mode
    gamma: float = ADVANTAGE.gamma
    lam: float = ADVANTAGE.lam
    std_normalize: bool = ADVANTAGE.std_normalize
    whiten_advantages: bool = ADVANTAGE.whiten
    value_coef: float = LOSS.value_coef
    value_clip: float | None = LOSS.value_clip
    # On-policy distillation shaping: A -= coef * (logp_student - logp_teacher).
    distillation_coef: float = ADVANTAGE.distillation_coef
    # Features that read the policy's log-probs before the first optimizer step.
    mismatch_metrics: bool = False
    # MoE models only: whose experts the trainer's forwards route each token to (RoutingReplay).
    routing_replay: RoutingReplay = "off"
    # MoE models only: the router's load-balancing loss and z-loss, added to the policy loss
    # with these coefficients on every backend (`unirl.core.moe_loss`); 0 leaves a term out.
    router_aux_loss_coef: float = ROUTER.aux_coef
    router_z_loss_coef: float = ROUTER.z_coef
    # "package.module:function" called as hook(batch, *, rl_step) -> RolloutBatch on every
    # rollout before it is trained on (user code, like any plug-in; unirl/rollouts/postprocess.py).
    rollout_postprocess_hook: str | None = None
    # How long the other ranks wait for the hook, which runs once on global rank 0, before they
    # stop the run with an error naming it (None: as long as it runs). Its own bound, never
    # parallel.timeout_s (a hook that calls a remote judge may take longer than a collective).
    rollout_postprocess_timeout_s: float | None = attrs.field(
        default=1800.0, validator=attrs.validators.optional(positive)
    )
    # A sample cut at rollout.max_new_tokens (or an episode cut at its turn or token limit) gets
    # an all-zero loss mask: no policy-gradient tokens, and the step's token and sequence counts
    # leave it out (unirl/core/data/truncation.py); its reward still enters its group's baseline.
    mask_truncated: bool = False

    def __attrs_post_init__(self) -> None:
        self.loss_settings()
        self.advantage_settings()
        self.router_coefficients()

    def loss_settings(self, *, decoupled: bool = False) -> LossSettings:
        """The loss settings these keys set, with ``decoupled`` what ``algorithm.decoupled: auto``
        resolved to (a forced true / false wins); a bad value raises `ConfigError` naming its
        key."""
        forced = self.decoupled if isinstance(self.decoupled, bool) else decoupled
        return build_settings(self, LossSettings, decoupled=forced)

    def router_coefficients(self) -> RouterCoefficients:
        """The MoE router terms' coefficients these keys set (`ConfigError` naming the key)."""
        return build_settings(self, RouterCoefficients)

    def advantage_settings(self) -> AdvantageSettings:
        """The advantage settings these keys set; a bad value raises `ConfigError` naming its
        key."""
        return build_settings(self, AdvantageSettings)


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
