"""Router disagreement under routing replay: how often the trainer's own router would have chosen
other experts than the replayed ones.

One routing *decision* is one token at one MoE layer: the set of its top-k experts. The metric is

    router/disagreement = (decisions whose free top-k set != the replayed set) / (replayed decisions)

counted over the real, replayed positions only (`FREE` rows, the last token of each sequence and
context-parallel padding, are the router's own choice and are left out of both counts). The order
inside a top-k does not matter (a set), so an engine that lists a token's experts in another order
agrees. The denominator is a count of decisions, not of tokens: reduced with `reduce_metrics` it
sums over layers, microbatches and ranks before dividing, so a short microbatch weighs what its
decisions weigh. A pipeline stage sees only its own layers: the stages' numerators and
denominators add up to the model's (sum them over the pipeline group before dividing).
"""

from __future__ import annotations

import torch

from unirl.core.data.routed_experts import FREE
from unirl.core.errors import LossInputError
from unirl.core.maths.losses.metrics import Metric

ROUTER_DISAGREEMENT = "router/disagreement"


def routing_disagreement(
    free_nk: torch.Tensor, replayed_nk: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(differing decisions, replayed decisions)`` of one MoE layer, as 0-d int64 tensors on
    the inputs' device (no host sync): rows of ``replayed_nk`` that are `FREE` are not counted.
    ``free_nk`` / ``replayed_nk``: ``[tokens, top_k]`` expert indices."""
    if free_nk.shape != replayed_nk.shape or free_nk.dim() != 2:
        raise LossInputError(
            f"routing_disagreement: free top-k {tuple(free_nk.shape)} and replayed top-k "
            f"{tuple(replayed_nk.shape)} must both be [tokens, top_k]"
        )
    replayed = replayed_nk[:, 0] != FREE
    same = (free_nk.sort(dim=-1).values == replayed_nk.sort(dim=-1).values).all(dim=-1)
    differing = (replayed & ~same).sum()
    return differing, replayed.sum()


def router_disagreement_metric(differing: torch.Tensor, decisions: torch.Tensor) -> Metric:
    """The ``router/disagreement`` metric of one microbatch from its counts summed over layers."""
    return Metric(
        numerator=differing.to(torch.float64),
        denominator=decisions.to(torch.float64),
        kind="decisions",
    )
