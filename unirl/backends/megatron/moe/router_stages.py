"""The router losses of an MoE model split over pipeline stages: each stage backpropagates its own
layers' share, exactly.

Why not the loss function: megatron calls it on the last stage only, and the router logits of the
other stages' layers live there, with their autograd graphs; sending them along would need a
second tensor in megatron's point-to-point protocol. Why shares: ``aux = E * sum_e (A_e / R)
(S_e / R)`` pools the top-k counts ``A_e`` and the rows ``R`` of every layer of the forward
(`unirl.core.maths.losses.router`), so one stage's ``aux`` is not its part of the model's. With
the pooled ``A_e`` and ``R`` (no gradient) each stage's `router_loss_shares` is linear in its own
probability sums, and the shares add up to the model's ``aux`` and ``z`` and so do their
gradients.

How (megatron's ``MoEAuxLossAutoScaler`` pattern): after each chunk's forward, `StageRouterLosses`
computes the chunk's `router_statistics` and passes the chunk's output through `_StageShare`,
an identity in the forward whose backward also hands its share's gradient to the statistics
(so to the router weights and everything below them). The pooled counts come from an
asynchronous all-reduce over the pipeline group issued after the rank's last chunk of the
microbatch ran, and waited for in the backward: every stage has run that microbatch's forward
by then (the backward of a microbatch starts on the last stage), so nothing blocks in the
forward, where the schedule's sends and receives are still pending. The all-reduce runs on a
group of its own (the pipeline ranks again), not on megatron's pipeline group, whose in-order
point-to-point traffic (NCCL) would otherwise interleave with it and deadlock.

Weighting: the share's gradient is scaled as megatron scales the last stage's loss (the grad
scale, ``cp / num_microbatches``) times `MicrobatchLoop.loss_scale`, and the term itself is
core's `router_loss_term` (the microbatch's tokens over the step's, ``global_tokens``). The last
stage reports the metrics ``router/aux_loss`` / ``router/z_loss`` of the pooled values.
Context parallel together with pp > 1 is refused by the plug-in's check (the pooling would need
the pipeline x context group).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from unirl.backends.megatron.moe.layers import microbatch_router_logits
from unirl.core.data.microbatch import TrainMicrobatch
from unirl.core.maths.losses import Metric
from unirl.core.maths.losses.router import (
    RouterStatistics,
    router_loss_shares,
    router_loss_term,
    router_statistics,
)
from unirl.core.moe_loss import RouterLossSettings, real_logits

_EXCHANGE_GROUPS: dict[tuple[int, ...], Any] = {}


def exchange_group(pp_group: Any) -> Any:
    """A process group with the ranks of ``pp_group``, separate from it (see the module
    docstring). Collective over the world the first time: every rank creates every pipeline
    group's copy, in the same order."""
    mine = tuple(dist.get_process_group_ranks(pp_group))
    if mine not in _EXCHANGE_GROUPS:
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        for ranks in sorted(set(everyone)):
            group = dist.new_group(list(ranks))
            if ranks == mine:
                _EXCHANGE_GROUPS[mine] = group
    return _EXCHANGE_GROUPS[mine]


class _Pooled:
    """One microbatch's pooled statistics: ``[A_e (E), S_e (E), lse_sq_sum, rows]`` fp64, summed
    over the pipeline stages by an asynchronous all-reduce."""

    def __init__(self, local: torch.Tensor, group: Any) -> None:
        self.buffer = local
        self.work = dist.all_reduce(self.buffer, group=group, async_op=True)
        self.done = False

    def value(self) -> torch.Tensor:
        if not self.done:
            self.work.wait()
            self.done = True
        return self.buffer


class _StageShare(torch.autograd.Function):
    """Identity on the chunk's output; its backward also gives ``factor * d share`` to the
    chunk's probability sums and ``lse_sq_sum`` (the pooled counts read when backward runs)."""

    @staticmethod
    def forward(
        ctx: Any,
        output: torch.Tensor,
        prob_sum_e: torch.Tensor,
        lse_sq_sum: torch.Tensor,
        pooled: _Lazy,
        coef: tuple[float, float, int],
    ) -> torch.Tensor:
        ctx.pooled, ctx.coef = pooled, coef
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        aux_w, z_w, experts = ctx.coef
        pooled = ctx.pooled.value()
        rows = max(float(pooled[-1]), 1.0)
        assignments_e = pooled[:experts].float()
        # d/dS_e of aux_w * E * sum_e (A_e / R)(S_e / R), d/dlse of z_w * lse / R
        grad_prob = (aux_w * experts / rows**2) * assignments_e
        grad_lse = torch.full((), z_w / rows, dtype=torch.float32, device=grad_output.device)
        return grad_output, grad_prob.to(grad_output.device), grad_lse, None, None


class StageRouterLosses:
    """The router-loss shares of one training pass under pp > 1 (see the module docstring)."""

    def __init__(
        self,
        settings: RouterLossSettings,
        *,
        pp_group: Any,
        num_local_chunks: int,
        backward_scale: float,
        global_tokens: int,
    ) -> None:
        self.settings = settings
        self.group = exchange_group(pp_group)
        self.num_local_chunks = num_local_chunks
        self.backward_scale = backward_scale
        self.global_tokens = global_tokens
        self.local: dict[int, list[torch.Tensor]] = {}
        self.pooled: dict[int, _Pooled] = {}
        self.tokens: dict[int, int] = {}

    def stage_output(
        self,
        index: int,
        mb: TrainMicrobatch | None,
        batch: Any,
        chunk: torch.nn.Module,
        vp_stage: int | None,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """The chunk's output, carrying this chunk's share of microbatch ``index``'s router
        term in its backward (a padding microbatch, ``mb`` None: the output unchanged)."""
        logits = microbatch_router_logits([chunk], batch)
        if mb is None:
            return output
        shape = self.settings.shape
        stats = self._statistics(logits, mb)
        vector = torch.cat(
            [
                stats.assignments_e.double(),
                stats.prob_sum_e.detach().double(),
                stats.lse_sq_sum.detach().double()[None],
                stats.assignments_e.new_tensor([stats.rows], dtype=torch.float64),
            ]
        )
        parts = self.local.setdefault(index, [])
        parts.append(vector)
        if vp_stage is None or vp_stage == self.num_local_chunks - 1:
            self.pooled[index] = _Pooled(torch.stack(parts).sum(0), self.group)
            self.tokens[index] = mb.num_tokens
        if not logits:
            return output
        share = self.backward_scale * mb.num_tokens / max(self.global_tokens, 1)
        coef = (
            self.settings.router_coefficients.aux_coef * share,
            self.settings.router_coefficients.z_coef * share,
            shape.num_experts,
        )
        # the pooled counts of this microbatch: issued by this rank's last chunk, before any
        # backward of the microbatch runs
        pooled = _Lazy(self.pooled, index)
        return _StageShare.apply(output, stats.prob_sum_e, stats.lse_sq_sum, pooled, coef)

    def _statistics(self, logits: Sequence[torch.Tensor], mb: TrainMicrobatch) -> RouterStatistics:
        shape = self.settings.shape
        if not logits:  # a chunk of dense layers only
            zeros = torch.zeros(shape.num_experts, dtype=torch.float32, device=mb.tokens.device)
            return RouterStatistics(
                assignments_e=zeros, prob_sum_e=zeros, lse_sq_sum=zeros.sum(), rows=0
            )
        return router_statistics(
            real_logits(logits, mb), top_k=shape.top_k, num_experts=shape.num_experts
        )

    def metrics(self) -> dict[int, Mapping[str, Metric]]:
        """Per microbatch index: ``router/aux_loss`` and ``router/z_loss`` of the pooled values
        (the whole model's, as core's `router_term` reports them at pp = 1)."""
        out = {}
        experts = self.settings.shape.num_experts
        for index, pooled in self.pooled.items():
            vector = pooled.value()
            rows = int(vector[-1])
            stats = RouterStatistics(
                assignments_e=vector[:experts].float(),
                prob_sum_e=vector[experts : 2 * experts].float(),
                lse_sq_sum=vector[2 * experts].float(),
                rows=rows,
            )
            aux, z = router_loss_shares(stats, assignments_e=stats.assignments_e, rows=rows)
            term = router_loss_term(
                aux,
                z,
                aux_coef=self.settings.router_coefficients.aux_coef,
                z_coef=self.settings.router_coefficients.z_coef,
                microbatch_tokens=self.tokens[index],
                global_tokens=self.global_tokens,
            )
            out[index] = term.metrics
        return out


class _Lazy:
    """``pooled[index]``, looked up when the backward needs it (under VPP the rank's last chunk
    issues the all-reduce after the earlier chunks' outputs were made)."""

    def __init__(self, pooled: dict[int, _Pooled], index: int) -> None:
        self.pooled, self.index = pooled, index

    def value(self) -> torch.Tensor:
        return self.pooled[self.index].value()
