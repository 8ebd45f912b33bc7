"""The loss of one microbatch: policy term, KL, entropy bonus and value term, aggregated once.

Per token, with ``w_t`` the rollout-correction weight or decoupled PPO's behaviour weight (1 when
off; both are the proximal / behaviour ratio, so the settings allow one at a time)::

    total_t = w_t pg_t + kl_loss_coef kl_t - entropy_coef H_t + value_coef v_t

and ``loss = aggregate(total_t)`` with the global normalisers of the step, so the sum of
`compute_loss` over every microbatch and every DP x CP rank is the objective of the whole
optimizer step (the backend multiplies by the one factor that cancels its own averaging).
"""

from __future__ import annotations

import attrs
import torch

from unirl.core.data.counts import GlobalCounts
from unirl.core.errors import LossInputError
from unirl.core.maths.kl import kl_estimate
from unirl.core.maths.losses.aggregation import (
    aggregate,
    aggregate_metric,
    token_max_metric,
    token_mean_metric,
)
from unirl.core.maths.losses.decoupled import decoupled_weight
from unirl.core.maths.losses.inputs import LossInputs
from unirl.core.maths.losses.metrics import Metric
from unirl.core.maths.losses.registry import get_policy_loss
from unirl.core.maths.losses.rollout_correction import rollout_correction_weight
from unirl.core.maths.losses.settings import LossSettings
from unirl.core.maths.losses.value import value_loss


@attrs.frozen(kw_only=True, eq=False)
class LossOutput:
    """This microbatch's share of the step loss (scalar, with grad) and its metrics."""

    loss: torch.Tensor
    metrics: dict[str, Metric]


def compute_loss(
    inp: LossInputs,
    counts: GlobalCounts,
    settings: LossSettings,
    *,
    validate: bool = True,
    pg_weight: torch.Tensor | None = None,
) -> LossOutput:
    """Loss and metrics of one microbatch on this rank.

    ``validate`` checks the inputs first (shapes, and one host sync for finiteness); turn it off
    only where the same inputs were validated already. ``inp.entropy`` enters the loss only when
    ``entropy_coef != 0``; otherwise it is only reported, detached. The KL term likewise needs
    ``ref_logprobs`` only when ``kl_loss_coef != 0``. ``pg_weight`` ``[T]`` is a per-token weight
    of the policy-gradient term computed elsewhere (another framework's rollout correction, e.g.
    verl's ``rollout_is_weights``), applied detached like ``rollout_correction``'s.
    """
    if validate:
        inp.validate()
    mode = settings.loss_aggregation
    old = inp.resolved_old_logprobs().detach()
    metrics: dict[str, Metric] = {}
    total_t = _policy_term(inp, counts, settings, old, pg_weight, metrics)
    total_t = _kl_term(total_t, inp, counts, settings, metrics)
    total_t = _entropy_term(total_t, inp, settings, metrics)
    total_t = _value_term(total_t, inp, counts, settings, metrics)
    loss = aggregate(total_t, inp, counts, mode)
    metrics["loss"] = aggregate_metric(total_t, inp, counts, mode)
    return LossOutput(loss=loss, metrics=metrics)


def _policy_term(
    inp: LossInputs,
    counts: GlobalCounts,
    settings: LossSettings,
    old: torch.Tensor,
    pg_weight: torch.Tensor | None,
    metrics: dict[str, Metric],
) -> torch.Tensor:
    """``w_t pg_t``: the policy loss per token times its detached weights (rollout correction,
    decoupled PPO's behaviour weight, ``pg_weight``); adds its metrics to ``metrics``."""
    pg_t, policy_metrics = get_policy_loss(settings.policy_loss)(inp, counts, settings)
    if pg_t.shape != inp.logprobs.shape:
        raise LossInputError(
            f"policy loss {settings.policy_loss!r} returned shape {tuple(pg_t.shape)}; a policy "
            f"loss returns the per-token loss, shape {tuple(inp.logprobs.shape)} like logprobs "
            "(compute_loss masks and aggregates it)"
        )
    metrics.update(policy_metrics)
    weight_t, correction_metrics = rollout_correction_weight(inp, settings)
    metrics.update(correction_metrics)
    if weight_t is not None:
        pg_t = pg_t * weight_t
    behaviour_t, decoupled_metrics = decoupled_weight(inp, settings)
    metrics.update(decoupled_metrics)
    if behaviour_t is not None:
        pg_t = pg_t * behaviour_t
    if pg_weight is not None:
        pg_t = pg_t * pg_weight.detach()
    metrics["pg_loss"] = aggregate_metric(pg_t, inp, counts, settings.loss_aggregation)
    metrics["ppo_kl"] = token_mean_metric(old - inp.logprobs.detach(), inp.mask)
    if inp.rollout_logprobs is not None:
        # Train / rollout mismatch on the rollout's own tokens: a stale engine (a weight sync
        # that did not happen) or a numerics gap shows here. The KL is KL(rollout || train) by
        # the k3 estimator (unbiased and >= 0 for tokens drawn from the rollout's policy).
        abs_diff_t = (old - inp.rollout_logprobs).abs()
        metrics["train_rollout_logprob_abs_diff"] = token_mean_metric(abs_diff_t, inp.mask)
        metrics["train_rollout_logprob_abs_diff_max"] = token_max_metric(abs_diff_t, inp.mask)
        metrics["train_rollout_kl"] = token_mean_metric(
            kl_estimate(inp.rollout_logprobs, old.detach(), "k3"), inp.mask
        )
    return pg_t


def _kl_term(
    total_t: torch.Tensor,
    inp: LossInputs,
    counts: GlobalCounts,
    settings: LossSettings,
    metrics: dict[str, Metric],
) -> torch.Tensor:
    """``+ kl_loss_coef kl_t`` when the coefficient is set; the KL is reported either way when
    the reference log-probs are there."""
    if settings.kl_loss_coef != 0:
        if inp.ref_logprobs is None:
            raise LossInputError(
                f"kl_loss_coef={settings.kl_loss_coef} needs LossInputs.ref_logprobs (the "
                "reference model's log-probs); compute them or set kl_loss_coef: 0"
            )
        kl_t = kl_estimate(inp.logprobs, inp.ref_logprobs, settings.kl_loss_estimator)
        total_t = total_t + settings.kl_loss_coef * kl_t
        metrics["kl_loss"] = aggregate_metric(kl_t, inp, counts, settings.loss_aggregation)
        metrics["kl"] = token_mean_metric(kl_t, inp.mask)
    elif inp.ref_logprobs is not None:
        with torch.no_grad():
            kl_t = kl_estimate(inp.logprobs, inp.ref_logprobs, settings.kl_loss_estimator)
        metrics["kl"] = token_mean_metric(kl_t, inp.mask)
    return total_t


def _entropy_term(
    total_t: torch.Tensor, inp: LossInputs, settings: LossSettings, metrics: dict[str, Metric]
) -> torch.Tensor:
    """``- entropy_coef H_t`` when the coefficient is set; the entropy is reported either way
    when it is there."""
    if settings.entropy_coef != 0:
        if inp.entropy is None:
            raise LossInputError(
                f"entropy_coef={settings.entropy_coef} needs LossInputs.entropy; compute the "
                "entropy with the log-probs (with grad) or set entropy_coef: 0"
            )
        # Minus: the bonus rewards a higher entropy.
        total_t = total_t - settings.entropy_coef * inp.entropy
        metrics["entropy"] = token_mean_metric(inp.entropy, inp.mask)
    elif inp.entropy is not None:
        metrics["entropy"] = token_mean_metric(inp.entropy, inp.mask)
    return total_t


def _value_term(
    total_t: torch.Tensor,
    inp: LossInputs,
    counts: GlobalCounts,
    settings: LossSettings,
    metrics: dict[str, Metric],
) -> torch.Tensor:
    """``+ value_coef v_t`` when the inputs carry values (a critic trained by this loss)."""
    if inp.values is None:
        return total_t
    if inp.returns is None:
        raise LossInputError(
            "LossInputs.values is given but LossInputs.returns is None; the value loss "
            "regresses values on returns — pass the returns (e.g. from GAE)"
        )
    v_t, vf_clipped = value_loss(inp.values, inp.returns, inp.old_values, settings.value_clip)
    metrics["value_loss"] = aggregate_metric(v_t, inp, counts, settings.loss_aggregation)
    metrics["vf_clipfrac"] = token_mean_metric(vf_clipped, inp.mask)
    return total_t + settings.value_coef * v_t
