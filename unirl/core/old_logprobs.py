"""Where the PPO "old" log-probs come from: recompute, reuse, or the rollout engine's.

- ``recompute``: a forward-only pass of the policy before the first optimizer step.
- ``reuse``: the training forward's own log-probs, detached. Valid only while the policy at the
  training forward is the policy that generated the data *as far as any feature can tell*: one
  optimizer step per rollout and nothing that reads the policy's log-probs before that step. The
  ratio is then exactly 1 and the forward-only pass — about a third of the actor's compute — is
  skipped.
- ``rollout``: the rollout engine's log-probs (they must be present in the data).

These are the *proximal* log-probs of the three roles (`unirl.core.maths.losses.inputs`):
current (the training forward's), proximal (what the PPO ratio is clipped against) and behaviour
(the rollout engine's, of the weights that generated the sample; `logprob_roles` says where each
comes from). On-policy data has behaviour = proximal; stale data (asynchronous training, an old
rollout file) does not, which is the ``stale_samples`` need.

Instead of a hand-kept chain of flags, each feature that needs the policy's log-probs before the
first optimizer step declares that need (a registered function of the config returning a reason,
or None). `auto` reuses exactly when no need is active. The decision is a frozen value that carries
its active needs as reasons; it is printed once, and again when it changes between rollouts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal

import attrs

from unirl.core.config.run_config import UnirlConfig
from unirl.core.data.rollout import RolloutBatch
from unirl.core.errors import ConfigError

logger = logging.getLogger(__name__)

Source = Literal["recompute", "reuse", "rollout"]


@attrs.frozen
class Need:
    """One feature's need for pre-step policy log-probs, with the reason in words."""

    feature: str
    reason: str


@attrs.frozen(kw_only=True)
class RolloutShape:
    """What the decision may depend on beyond the config: the rollout actually received."""

    samples: int
    optimizer_steps: int
    # How many optimizer steps the policy at the training forward is ahead of the oldest policy
    # that generated a sample (0: on-policy, or the versions are unknown).
    staleness: int = 0


NeedCheck = Callable[[UnirlConfig, RolloutShape], "str | None"]
_NEEDS: dict[str, NeedCheck] = {}


def register_need(feature: str) -> Callable[[NeedCheck], NeedCheck]:
    """Declare that `feature` may need the policy's log-probs before the first optimizer step.

    The function returns a reason (the need is active) or None. New features register here;
    nothing else has to change for the decision to stay right. A feature outside unirl (a
    plug-in module) registers at import, before the config is checked::

        @register_need("my_reward_shaping")
        def _needs(cfg: UnirlConfig, shape: RolloutShape) -> str | None:
            return "my reward shaping reads the policy's log-probs" if my_feature_on(cfg) else None
    """

    def deco(fn: NeedCheck) -> NeedCheck:
        if feature in _NEEDS:
            raise ValueError(f"need {feature!r} is already registered")
        _NEEDS[feature] = fn
        return fn

    return deco


def registered_needs() -> tuple[str, ...]:
    return tuple(_NEEDS)


@register_need("multiple_optimizer_steps")
def _multiple_steps(cfg: UnirlConfig, shape: RolloutShape) -> str | None:
    if shape.optimizer_steps > 1:
        b = cfg.batch
        return (
            f"{shape.optimizer_steps} optimizer steps per rollout ({shape.samples} samples / "
            f"batch.samples_per_optimizer_step={b.samples_per_optimizer_step} x "
            f"batch.epochs_per_rollout={b.epochs_per_rollout}): after the first step the policy "
            "differs from the one that generated the data"
        )
    return None


@register_need("stale_samples")
def _stale(cfg: UnirlConfig, shape: RolloutShape) -> str | None:
    if shape.staleness > 0:
        return (
            f"samples up to {shape.staleness} policy version(s) older than the policy at the "
            "training forward (policy_version < current): its own log-probs are not the ones "
            "that generated the data, so the proximal log-probs are computed before the step"
        )
    return None


@register_need("kl_in_reward")
def _kl_in_reward(cfg: UnirlConfig, shape: RolloutShape) -> str | None:
    coef = cfg.algorithm.kl_in_reward.coef
    if coef > 0:
        return (
            f"algorithm.kl_in_reward.coef={coef}: the reward is shaped with KL(policy || ref), "
            "computed from policy log-probs before advantages"
        )
    return None


@register_need("distillation_shaping")
def _distillation(cfg: UnirlConfig, shape: RolloutShape) -> str | None:
    coef = cfg.algorithm.distillation_coef
    if coef > 0:
        return (
            f"algorithm.distillation_coef={coef}: on-policy distillation shapes advantages with "
            "the student's log-probs before training"
        )
    return None


@register_need("mismatch_metrics")
def _mismatch(cfg: UnirlConfig, shape: RolloutShape) -> str | None:
    if cfg.algorithm.mismatch_metrics:
        return "algorithm.mismatch_metrics: compares the trainer's log-probs with the rollout's"
    return None


@register_need("routing_replay")
def _routing_replay(cfg: UnirlConfig, shape: RolloutShape) -> str | None:
    # R2 records in the forward-only pass; R3 replays the engine's experts from the data, so its
    # old log-probs may come from the training forward like any other run's.
    if cfg.algorithm.routing_replay == "record":
        return (
            "algorithm.routing_replay=record: the old-log-prob forward records each MoE layer's "
            "experts per token, which the training forwards then replay"
        )
    return None


@register_need("value_estimator")
def _values(cfg: UnirlConfig, shape: RolloutShape) -> str | None:
    from unirl.core.maths.advantages import estimator_needs_values

    name = cfg.algorithm.advantage_estimator
    if estimator_needs_values(name):
        return f"algorithm.advantage_estimator={name!r} uses a critic's values (PPO with GAE)"
    return None


@register_need("advantage_estimator")
def _estimator(cfg: UnirlConfig, shape: RolloutShape) -> str | None:
    from unirl.core.maths.advantages import estimator_needs_old_logprobs, estimator_needs_values

    name = cfg.algorithm.advantage_estimator
    if estimator_needs_values(name):
        return None  # reported once, by value_estimator
    if estimator_needs_old_logprobs(name):
        custom = ":" in name
        why = "a custom estimator that does not declare otherwise" if custom else "it reads them"
        return f"algorithm.advantage_estimator={name!r} needs pre-step log-probs ({why})"
    return None


@register_need("policy_loss")
def _policy_loss(cfg: UnirlConfig, shape: RolloutShape) -> str | None:
    from unirl.core.maths.losses import policy_loss_needs_old_logprobs

    name = cfg.algorithm.policy_loss
    if policy_loss_needs_old_logprobs(name):
        return (
            f"algorithm.policy_loss={name!r} needs pre-step log-probs (a custom loss is assumed "
            "to unless registered with needs_old_logprobs=False)"
        )
    return None


def _loss_reads_behaviour(cfg: UnirlConfig) -> bool:
    from unirl.core.maths.losses import policy_loss_reads_behaviour

    return policy_loss_reads_behaviour(cfg.algorithm.policy_loss)


@attrs.frozen
class DecoupledChoice:
    """Whether decoupled PPO's behaviour weight is on for a rollout, with the reason in words."""

    on: bool
    reason: str

    def explain(self) -> str:
        return f"decoupled PPO: {'on' if self.on else 'off'} ({self.reason})"


def decide_decoupled(
    cfg: UnirlConfig, staleness: int = 0, *, has_behaviour: bool = True
) -> DecoupledChoice:
    """``algorithm.decoupled`` resolved for a rollout whose oldest sample is ``staleness`` policy
    versions behind the trained policy; ``has_behaviour``: the rollout carries the engine's
    log-probs. The one place its ``auto`` default is decided: on exactly when samples can be
    stale (``train.max_staleness > 0``, or this rollout is) and the behaviour log-probs are
    there, unless something else already accounts for the behaviour policy. On-policy data
    keeps it off: its weight exp(proximal - behaviour) is 1 up to the trainer / engine
    numerics, so a synchronous run stays number for number what it was."""
    a = cfg.algorithm
    if isinstance(a.decoupled, bool):
        return DecoupledChoice(a.decoupled, f"algorithm.decoupled: {str(a.decoupled).lower()}")
    k = cfg.train.max_staleness
    if k == 0 and staleness <= 0:
        return DecoupledChoice(
            False, "auto: on-policy data (train.max_staleness: 0, no stale sample), weight 1"
        )
    if a.rollout_correction.mode != "none":
        return DecoupledChoice(
            False,
            f"auto: algorithm.rollout_correction.mode={a.rollout_correction.mode} weights by the "
            "proximal / behaviour ratio instead",
        )
    if cfg.old_logprobs == "rollout":
        return DecoupledChoice(
            False, "auto: old_logprobs: rollout makes proximal = behaviour (weight 1)"
        )
    if not has_behaviour:
        return DecoupledChoice(
            False, "auto: the rollout has no rollout_logprobs (the behaviour log-probs)"
        )
    if _loss_reads_behaviour(cfg):
        return DecoupledChoice(
            False,
            f"auto: algorithm.policy_loss={a.policy_loss} reads the behaviour log-probs itself "
            "(its sampler's), with no importance weight on its advantage term",
        )
    why = f"train.max_staleness={k}" if k else f"samples up to {staleness} version(s) stale"
    return DecoupledChoice(
        True,
        f"auto: {why}; each token weighted by min(exp(proximal - behaviour), "
        f"algorithm.decoupled_cap={a.decoupled_cap})",
    )


@attrs.frozen(kw_only=True)
class OldLogprobDecision:
    requested: str
    source: Source
    needs: tuple[Need, ...]
    # Decoupled PPO's behaviour weight, decided with the proximal source (it divides by it).
    decoupled: DecoupledChoice

    def explain(self) -> str:
        head = f"old log-probs: {self.source} (requested: {self.requested})"
        tail = "\n" + self.decoupled.explain()
        if self.needs:
            lines = [f"  - {n.feature}: {n.reason}" for n in self.needs]
            body = "; needed before the first optimizer step by:\n" + "\n".join(lines)
        elif self.source == "reuse":
            body = "; no feature needs them before the first step, the forward-only pass is skipped"
        else:
            body = "; no feature needs them before the first step (reuse would be valid)"
        return head + body + tail

    def to_dict(self) -> dict[str, object]:
        return {
            "requested": self.requested,
            "source": self.source,
            "needs": [{"feature": n.feature, "reason": n.reason} for n in self.needs],
            "decoupled": {"on": self.decoupled.on, "reason": self.decoupled.reason},
        }


def active_needs(cfg: UnirlConfig, shape: RolloutShape) -> tuple[Need, ...]:
    needs = []
    for feature, check in _NEEDS.items():
        reason = check(cfg, shape)
        if reason is not None:
            needs.append(Need(feature, reason))
    return tuple(needs)


def rollout_staleness(batch: RolloutBatch, policy_version: int | None) -> int:
    """How many versions ``policy_version`` (the trained policy's) is ahead of the oldest sample
    of ``batch``; 0 when either is unknown (a file without versions, a caller without one)."""
    if policy_version is None:
        return 0
    versions = [s.policy_version for s in batch.samples if s.policy_version is not None]
    return max(0, policy_version - min(versions)) if versions else 0


def decide_old_logprobs(
    cfg: UnirlConfig,
    rollout_samples: int | None = None,
    *,
    staleness: int = 0,
    has_behaviour: bool = True,
) -> OldLogprobDecision:
    """Decide for a rollout of `rollout_samples` samples (default: the configured size) whose
    oldest sample is `staleness` policy versions behind the trained policy (and, with it,
    decoupled PPO: `decide_decoupled`; `has_behaviour`: the rollout has rollout_logprobs)."""
    samples = rollout_samples if rollout_samples is not None else cfg.layout.rollout_samples
    per_step = cfg.batch.samples_per_optimizer_step
    steps = -(-samples // per_step) * cfg.batch.epochs_per_rollout
    shape = RolloutShape(samples=samples, optimizer_steps=steps, staleness=staleness)
    needs = active_needs(cfg, shape)
    mode = cfg.old_logprobs
    if mode == "reuse" and needs:
        listed = "; ".join(f"{n.feature} ({n.reason})" for n in needs)
        raise ConfigError(
            f"old_logprobs: reuse is invalid while these features need the policy's log-probs "
            f"before the first optimizer step: {listed}. Use old_logprobs: auto or recompute, or "
            "turn those features off"
        )
    if mode == "auto":
        source: Source = "recompute" if needs else "reuse"
    else:
        source = mode  # type: ignore[assignment]
    return OldLogprobDecision(
        requested=mode,
        source=source,
        needs=needs,
        decoupled=decide_decoupled(cfg, staleness, has_behaviour=has_behaviour),
    )


def configured_staleness(cfg: UnirlConfig) -> int:
    """The staleness ``train.max_staleness`` allows, in policy versions (optimizer steps):
    what `unirl check` decides for, before any rollout exists."""
    return cfg.train.max_staleness * cfg.layout.optimizer_steps_per_rollout


def uncorrected_staleness(
    cfg: UnirlConfig, staleness: int, *, has_behaviour: bool = True
) -> str | None:
    """A warning when stale samples train without any off-policy correction, naming the fix;
    None when the data is on-policy or something corrects it."""
    a = cfg.algorithm
    decoupled = decide_decoupled(cfg, staleness, has_behaviour=has_behaviour)
    if staleness <= 0 or decoupled.on or a.rollout_correction.mode != "none":
        return None
    if has_behaviour and _loss_reads_behaviour(cfg):
        return None  # the loss measures the learner against the behaviour policy itself
    if not has_behaviour:
        fix = (
            "give the rollout the engine's rollout_logprobs (behaviour log-probs) so that "
            "algorithm.decoupled: auto can weight each token by its proximal / behaviour ratio"
        )
    elif cfg.old_logprobs == "rollout":
        fix = (
            "use old_logprobs: auto or recompute, so that the proximal policy is the trained one "
            "and algorithm.decoupled: auto weights each token by its proximal / behaviour ratio"
        )
    else:
        fix = (
            "set algorithm.decoupled: true or auto (decoupled PPO, weights each token by its "
            "proximal / behaviour ratio) or algorithm.rollout_correction.mode: tis"
        )
    return (
        f"the rollout is up to {staleness} policy version(s) stale and nothing corrects for it "
        f"({decoupled.explain()}): plain PPO treats it as on-policy; {fix}"
    )


def logprob_roles(cfg: UnirlConfig, decision: OldLogprobDecision) -> dict[str, str]:
    """Each log-prob role -> where it comes from in this run (`unirl check` prints it)."""
    proximal = {
        "recompute": "a forward-only pass of the policy before the first optimizer step",
        "reuse": "the training forward's own, detached (no extra pass; ratio exactly 1)",
        "rollout": "the rollout engine's (rollout_logprobs): behaviour = proximal",
    }[decision.source]
    a = cfg.algorithm
    users = [
        key
        for key, on in (
            (f"decoupled PPO ({decision.decoupled.reason})", decision.decoupled.on),
            (f"algorithm.rollout_correction.mode={a.rollout_correction.mode}",
             a.rollout_correction.mode != "none"),
            (f"algorithm.policy_loss={a.policy_loss} (its sampler log-probs)",
             _loss_reads_behaviour(cfg)),
        )
        if on
    ]  # fmt: skip
    behaviour = "the rollout engine's (rollout_logprobs), of the weights that generated each sample"
    behaviour += (
        f"; weights the loss through {', '.join(users)}"
        if users
        else f"; weights no token in this rollout ({decision.decoupled.explain()})"
    )
    return {
        "current": "the training forward (with grad)",
        "proximal": proximal,
        "behaviour": behaviour,
    }


class DecisionLog:
    """Logs the decision once, and again only when it changes between rollouts."""

    def __init__(self) -> None:
        self._last: OldLogprobDecision | None = None

    def update(self, decision: OldLogprobDecision) -> bool:
        if decision == self._last:
            return False
        verb = "changed:" if self._last is not None else ""
        logger.info("%s%s", f"{verb} " if verb else "", decision.explain())
        self._last = decision
        return True
