"""StableReinforce (the Tinker API's ``stable_reinforce``): REINFORCE on the sampled tokens with
a penalty on how far the learner has moved from the sampler, for data that is off-policy
(asynchronous sampling, or a sampler whose numerics differ from the trainer's)::

    loss_t = -( A_t logp_t - kl_coef * k3_t ),   k3_t = (rho_t - 1) - log rho_t,
    rho_t  = exp(logp_t - q_t)

``q_t`` is the sampler's log-prob of the token: the behaviour log-probs (``rollout_logprobs``,
the engine that generated the rollout) when the batch has them, else the proximal
``old_logprobs`` (`unirl serve` puts there what it recorded at sampling time); ``k3_t`` Schulman's non-negative, low-variance
estimator of KL(sampler || learner) on tokens drawn from the sampler. The advantage term carries
no importance ratio, so no ratio can blow a token's gradient up off-policy; the penalty pulls each
token back toward the sampler in proportion to how far it moved::

    d loss_t / d logp_t = -( A_t - kl_coef (rho_t - 1) )

On-policy (``rho_t = 1``) it is exactly REINFORCE. Tinker documents the name, that it is a
REINFORCE variant stable off-policy, that it reads what sampling recorded per sequence, and its
``kl_coeff`` (`unirl serve`'s ``loss_fn_config``; ``algorithm.stable_reinforce_kl_coef`` here); it
does not publish the objective, so this one is unirl's reading (`docs/guides/serve.md`).
"""

from __future__ import annotations

import torch

from unirl.core.data.counts import GlobalCounts
from unirl.core.maths.losses.inputs import LossInputs
from unirl.core.maths.losses.metrics import Metric
from unirl.core.maths.losses.registry import register_policy_loss
from unirl.core.maths.losses.settings import LossSettings


# reads_behaviour: its q is the engine's log-prob, so `algorithm.decoupled: auto` adds no
# proximal / behaviour weight (an importance ratio on the advantage term, which it leaves out)
@register_policy_loss(
    "stable_reinforce", needs_old_logprobs=False, separable=True, reads_behaviour=True
)
def stable_reinforce_loss(
    inp: LossInputs, counts: GlobalCounts, settings: LossSettings
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """Per-token StableReinforce loss (see the module docstring)."""
    sampler = inp.behaviour_logprobs
    log_ratio = inp.logprobs - (inp.resolved_old_logprobs() if sampler is None else sampler)
    k3 = torch.expm1(log_ratio) - log_ratio
    loss_t = -(inp.advantages * inp.logprobs - settings.stable_reinforce_kl_coef * k3)
    return loss_t, {}
