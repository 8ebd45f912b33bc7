"""The critic's loss of one microbatch: PPO's clipped value loss (`value.value_loss`), aggregated
like the policy loss and weighted by ``value_coef``::

    loss = value_coef * aggregate(0.5 * max((V - R)^2, (V_clip - R)^2))

with ``R`` the returns of GAE and ``V_clip`` the pre-step values moved by at most ``value_clip``.
The normalisers are the optimizer step's global counts, so the shares of every microbatch and
every data-parallel x context-parallel rank sum to the step's loss, as for the policy. With its
own optimizer the critic's ``value_coef`` scales its gradient (and so what its grad clip cuts).
"""

from __future__ import annotations

import torch

from unirl.core.data.counts import GlobalCounts
from unirl.core.maths.losses.aggregation import aggregate, aggregate_metric, token_mean_metric
from unirl.core.maths.losses.inputs import LossInputs
from unirl.core.maths.losses.settings import LossSettings
from unirl.core.maths.losses.total import LossOutput
from unirl.core.maths.losses.value import value_loss


def critic_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor | None,
    *,
    loss_mask: torch.Tensor,
    seq_ids: torch.Tensor,
    num_seqs: int,
    seq_token_counts: torch.Tensor,
    counts: GlobalCounts,
    settings: LossSettings,
) -> LossOutput:
    """This microbatch's share of the critic loss (scalar, with grad) and its metrics:
    ``value_loss`` (unweighted, as aggregated), ``vf_clipfrac``, ``values_mean``."""
    # The aggregation reads the mask, sequence ids and dtype; the values stand in as "logprobs".
    inp = LossInputs(
        logprobs=values,
        advantages=torch.zeros_like(values),
        loss_mask=loss_mask,
        seq_ids=seq_ids,
        num_seqs=num_seqs,
        seq_token_counts=seq_token_counts,
    )
    mode = settings.loss_aggregation
    v_t, clipped = value_loss(values, returns, old_values, settings.value_clip)
    loss = settings.value_coef * aggregate(v_t, inp, counts, mode)
    metrics = {
        "value_loss": aggregate_metric(v_t, inp, counts, mode),
        "vf_clipfrac": token_mean_metric(clipped, inp.mask),
        "values_mean": token_mean_metric(values.detach(), inp.mask),
    }
    return LossOutput(loss=loss, metrics=metrics)
