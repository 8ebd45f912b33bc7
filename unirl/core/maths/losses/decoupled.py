"""Decoupled PPO (AReaL: Fu et al., "AReaL: A Large-Scale Asynchronous Reinforcement Learning
System for Language Reasoning", 2025; Hilton et al., "Batch size-invariance for policy
optimization", 2022).

Three policies take part in an off-policy step: the *behaviour* policy that generated the token
(the rollout engine's log-probs, possibly several optimizer steps old), the *proximal* policy the
PPO ratio is clipped against (the "old" log-probs: recomputed before the first optimizer step),
and the *current* one (the training forward). Plain PPO assumes behaviour = proximal; with stale
samples it is not, and the clipped surrogate is re-weighted per token by the DETACHED, truncated
importance ratio of proximal to behaviour::

    w_t = min(exp(prox_logp_t - behav_logp_t), cap)                  (decoupled_cap_mode: truncate)
    w_t = exp(prox_logp_t - behav_logp_t) if it is <= cap, else 0    (decoupled_cap_mode: mask)
    loss_t = w_t * max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high)),  r_t = pi / pi_prox

The cap bounds the variance a very stale token could add. ``truncate`` (the default) keeps such a
token at weight ``cap``, as the paper's truncated importance weight; ``mask`` is what AReaL's code
(``ppo_actor_loss_fn``, ``behav_imp_weight_cap``) does: the token gets no policy gradient, but
stays in the loss's token count (its denominator), as it does there.
Metrics: ``decoupled_weight_mean`` and ``decoupled_clipfrac`` (the fraction past the cap).
"""

from __future__ import annotations

import math

import torch

from unirl.core.errors import LossInputError
from unirl.core.maths.losses.aggregation import token_mean_metric
from unirl.core.maths.losses.inputs import LossInputs
from unirl.core.maths.losses.metrics import Metric
from unirl.core.maths.losses.settings import LossSettings


def decoupled_weight(
    inp: LossInputs, settings: LossSettings
) -> tuple[torch.Tensor | None, dict[str, Metric]]:
    """The detached per-token behaviour weight, or None when ``decoupled`` is off."""
    if not settings.decoupled:
        return None, {}
    behaviour = inp.behaviour_logprobs
    if behaviour is None:
        raise LossInputError(
            "decoupled=True needs LossInputs.rollout_logprobs (the behaviour policy's, i.e. the "
            "rollout engine's, log-probs of the sampled tokens); return them from the rollout "
            "engine or set decoupled: false"
        )
    x = (inp.proximal_logprobs() - behaviour).detach()
    log_cap = math.log(settings.decoupled_cap)
    weight = torch.exp(x.clamp(max=log_cap))  # min(exp(x), cap) without overflow
    if settings.decoupled_cap_mode == "mask":
        weight = torch.where(x > log_cap, torch.zeros_like(weight), weight)
    metrics = {
        "decoupled_weight_mean": token_mean_metric(weight, inp.mask),
        "decoupled_clipfrac": token_mean_metric(x > log_cap, inp.mask),
    }
    return weight, metrics
