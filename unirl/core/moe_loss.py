"""The router's auxiliary losses of a mixture-of-experts policy as one optimizer step adds them:
the same on every backend, which only hands the router logits of its forward.

A backend's training forward returns, with the log-probs, each MoE layer's router logits
``[rows, num_experts]`` over the rows its router saw (the microbatch's packed tokens on this
rank; under context parallelism the rank's CP-local tokens, CP padding included; for an empty
microbatch none). `router_term` turns them into this microbatch's share of the step's router term
(`unirl.core.maths.losses.router`): padding rows dropped, the pieces of a context-parallel forward
pooled exactly (`router_statistics` summed over the CP group, `router_loss_shares`), weighted by
the microbatch's tokens over the step's (the plan's counts: no collective for that).

The coefficients are ``algorithm.router_aux_loss_coef`` and ``algorithm.router_z_loss_coef``
(`RouterLossSettings.from_config`), read by every backend through this module; Hugging Face's own
auxiliary loss (``output_router_logits`` with labels) is never added. The step hands a backend
one loss, `LossWithRouterTerm`, which holds the step's settings: it adds the term from the router
logits a backend passes, and a backend that cannot pass them (the layers of Megatron's earlier
pipeline stages) reads its ``router`` to add their share with the same coefficients.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist

from unirl.core.data.microbatch import TrainMicrobatch
from unirl.core.data.routed_experts import MoeShape
from unirl.core.maths.losses.metrics import Metric
from unirl.core.maths.losses.router import (
    RouterCoefficients,
    router_loss_shares,
    router_loss_term,
    router_statistics,
)
from unirl.core.maths.losses.total import LossOutput


@attrs.frozen(kw_only=True)
class RouterLossSettings:
    """What the router term needs besides the logits: the model's routing shape and the two
    coefficients."""

    shape: MoeShape
    router_coefficients: RouterCoefficients = attrs.field(factory=RouterCoefficients)

    @classmethod
    def from_config(cls, cfg: Any, shape: MoeShape) -> RouterLossSettings:
        """From a `UnirlConfig`'s ``algorithm`` section (not imported: core's config imports
        this package)."""
        return cls(shape=shape, router_coefficients=cfg.algorithm.router_coefficients())


def real_rows(mb: TrainMicrobatch) -> torch.Tensor:
    """``[T_local]`` bool: the rows of ``mb`` that are tokens of a sample (not CP padding). Under
    context parallelism a padded position continues its sequence's positions past its length."""
    if mb.global_cu_seqlens is None or mb.cp_group is None:
        return torch.ones(mb.num_tokens, dtype=torch.bool, device=mb.tokens.device)
    cu = mb.global_cu_seqlens.to(device=mb.position_ids.device, dtype=torch.long)
    lengths = cu[1:] - cu[:-1]
    return mb.position_ids < lengths[mb.seq_ids.to(mb.position_ids.device)]


def real_logits(router_logits: Sequence[torch.Tensor], mb: TrainMicrobatch) -> list[torch.Tensor]:
    """Each MoE layer's router logits at `real_rows`: without context parallel the microbatch's
    first ``num_tokens`` rows, a slice (a boolean mask per layer would read its count back to
    the host, twice per layer with the backward); under CP the real rows' index is found once
    per microbatch (one host sync) and taken from every layer."""
    if mb.global_cu_seqlens is None or mb.cp_group is None:
        return [lg[: mb.num_tokens] for lg in router_logits]
    index = real_rows(mb).nonzero().squeeze(1)
    return [lg[: mb.num_tokens].index_select(0, index.to(lg.device)) for lg in router_logits]


def microbatch_tokens(mb: TrainMicrobatch) -> int:
    """The tokens of the whole microbatch (every CP piece): the routed rows it weighs."""
    if mb.global_cu_seqlens is not None:
        return int(mb.global_cu_seqlens[-1])
    return mb.num_tokens


def router_term(
    router_logits: Sequence[torch.Tensor],
    mb: TrainMicrobatch,
    settings: RouterLossSettings,
    *,
    global_tokens: int,
) -> LossOutput:
    """This microbatch's share of the step's router loss and the metrics ``router/aux_loss``,
    ``router/z_loss`` (see the module docstring). ``global_tokens``: the tokens of every
    microbatch of every rank of the step (``sum(step.rank_tokens)``)."""
    shape = settings.shape
    aux_coef = settings.router_coefficients.aux_coef
    z_coef = settings.router_coefficients.z_coef
    if len(router_logits) != shape.num_moe_layers:
        raise ValueError(
            f"router_term: {len(router_logits)} router logits for a model with "
            f"{shape.num_moe_layers} MoE layers; the backend hands one per MoE layer"
        )
    stats = router_statistics(
        real_logits(router_logits, mb), top_k=shape.top_k, num_experts=shape.num_experts
    )
    tokens = microbatch_tokens(mb)
    group = mb.cp_group
    if group is None or dist.get_world_size(group) == 1:
        aux, z = router_loss_shares(stats, assignments_e=stats.assignments_e, rows=stats.rows)
        return router_loss_term(
            aux,
            z,
            aux_coef=aux_coef,
            z_coef=z_coef,
            microbatch_tokens=tokens,
            global_tokens=global_tokens,
        )
    # A forward split over CP ranks: pool the counts (no gradient), each rank its share.
    pooled = torch.cat([stats.assignments_e, stats.assignments_e.new_tensor([stats.rows])])
    dist.all_reduce(pooled, group=group)
    total_rows = int(pooled[-1])
    aux, z = router_loss_shares(stats, assignments_e=pooled[:-1], rows=total_rows)
    return router_loss_term(
        aux,
        z,
        aux_coef=aux_coef,
        z_coef=z_coef,
        microbatch_tokens=tokens,
        global_tokens=global_tokens,
        part=stats.rows / max(total_rows, 1),
    )


# policy(microbatch, log-probs [T], entropy [T] or None) -> (loss, metrics), router term excluded
PolicyTermFn = Callable[
    [TrainMicrobatch, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, Mapping[str, Metric]]
]


@attrs.frozen(kw_only=True)
class LossWithRouterTerm:
    """A `unirl.core.backend.LossFn`: ``policy``'s loss of a microbatch plus, for an MoE policy
    (``router`` set) whose forward's router logits the backend hands, the microbatch's router
    term (`router_term`). ``router`` is the step's settings (its ``algorithm`` section): one
    source for the term added here and for the shares a backend adds itself where it cannot hand
    the logits (Megatron under pp > 1, `unirl.backends.megatron.moe.router_stages`)."""

    policy: PolicyTermFn
    router: RouterLossSettings | None
    global_tokens: int  # the step's tokens, every microbatch of every rank

    def __call__(
        self,
        mb: TrainMicrobatch,
        logprobs: torch.Tensor,
        entropy: torch.Tensor | None,
        /,
        *,
        router_logits: Sequence[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, Mapping[str, Metric]]:
        loss, metrics = self.policy(mb, logprobs, entropy)
        if self.router is None or router_logits is None:
            return loss, metrics
        term = router_term(router_logits, mb, self.router, global_tokens=self.global_tokens)
        return loss + term.loss, {**metrics, **term.metrics}
