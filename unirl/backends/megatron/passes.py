"""The Megatron microbatch loop, written once: training and forward-only passes of any model the
backend holds (policy, reference, critic), each one call of megatron-core's schedule
(`schedule.run_schedule`).

Per microbatch, on the last pipeline stage: the model's `Head` turns the stage's output into
per-token results (log-probs and entropy, or values); a forward-only pass keeps the first of them,
detached; a training pass has the head compute the loss (`Head.loss`: core's loss function on
those results, or, with ``model.fused_head`` and a separable loss, inside core's fused head),
multiplies it by `loss_scale` (the one factor that cancels megatron's averaging), and connects an
empty microbatch's zero loss to the graph so that its backward (and the pipeline's gradient sends)
runs as for any other. Every rank counts one forward per real microbatch (``on_forward``) and the
reporting rank ticks the progress bar once per microbatch (`Topology.counts_microbatch`), under
virtual pipeline stages too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from unirl.backends.forward_only import forward_only
from unirl.backends.megatron import schedule
from unirl.backends.megatron.heads import HeadLossFn
from unirl.backends.megatron.moe.layers import collect_router_logits, microbatch_router_logits
from unirl.backends.megatron.moe.replay import ScheduleReplay, with_disagreement
from unirl.backends.megatron.moe.router_stages import StageRouterLosses
from unirl.backends.megatron.role_model import MegatronModel
from unirl.backends.megatron.schedule import (
    ScheduledMicrobatch,
    StageOutput,
    run_schedule,
    schedule_items,
)
from unirl.backends.microbatch import zero_through_graph
from unirl.core.backend import LogprobSpec
from unirl.core.data.microbatch import TrainMicrobatch
from unirl.core.maths.losses import Metric
from unirl.core.moe_loss import RouterLossSettings
from unirl.core.progress.bars import MicrobatchProgress
from unirl.core.topology import Topology

# (item, the last stage's output) -> (the loss megatron backpropagates, data for megatron)
_StageLoss = Callable[[ScheduledMicrobatch, torch.Tensor], tuple[torch.Tensor, Any]]


class MicrobatchLoop:
    """See the module docstring. One per backend: its topology, device and input form."""

    def __init__(
        self, topology: Topology, device: torch.device, *, packed: bool, seq_multiple: int = 1
    ) -> None:
        self.topology = topology
        self.device = device
        self.packed = packed  # megatron.attention: packed (THD streams) or right-padded rows
        self.seq_multiple = seq_multiple  # model input lengths' multiple (sequence parallel)

    def loss_scale(self, num_microbatches: int) -> float:
        """`schedule.loss_scale`; ``num_microbatches`` counts the schedule's padding ones too."""
        return schedule.loss_scale(num_microbatches, self.topology)

    def forward_only(
        self,
        model: MegatronModel,
        microbatches: Sequence[TrainMicrobatch],
        *,
        spec: LogprobSpec | None,
        on_forward: Callable[[], None],
        progress: MicrobatchProgress,
        replay: ScheduleReplay | None = None,
    ) -> list[torch.Tensor]:
        """The head's first result per microbatch, detached fp32 ([] off the last stage).
        ``replay``: the policy's routing replay / record (`unirl.backends.megatron.moe.replay`)."""
        if not microbatches:
            return []
        items, rows, seq_len = self._items(microbatches)
        results: dict[int, torch.Tensor] = {}

        def stage_loss(item: ScheduledMicrobatch, output: torch.Tensor) -> tuple[torch.Tensor, Any]:
            zero = torch.zeros((), device=self.device)
            if item.mb is None:
                return zero, {}
            first = model.head(model.chunks, item, output, spec)[0]
            assert first is not None
            results[item.index] = first.detach().float()
            progress.report(tokens=item.mb.num_tokens)
            return zero, {}

        with forward_only(model.modules, device=self.device, offloaded=model.offloaded):
            self._run(
                model,
                items,
                rows,
                seq_len,
                stage_loss,
                on_forward,
                progress,
                train=False,
                stage_output=None if replay is None else replay.after_forward,
                before_forward=None if replay is None else replay.before_forward,
            )
        return self._in_order(results, len(microbatches))

    def train(
        self,
        model: MegatronModel,
        microbatches: Sequence[TrainMicrobatch],
        *,
        loss_fn: HeadLossFn,
        spec: LogprobSpec | None,
        on_forward: Callable[[], None],
        progress: MicrobatchProgress,
        router_logits: bool = False,
        stage_router: RouterLossSettings | None = None,
        replay: ScheduleReplay | None = None,
    ) -> list[Mapping[str, Metric]]:
        """Accumulate the gradients of one optimizer step; its metrics per microbatch ([] off the
        last stage). One schedule call: megatron reduces the gradients at its end, so all
        microbatches of one optimizer step come in one call. An MoE policy's router losses: with
        ``router_logits`` (one pipeline stage) ``loss_fn`` gets each MoE layer's router logits
        of the microbatch (core adds the term); with ``stage_router`` (pp > 1: the step's
        settings) each stage backpropagates its layers' share
        (`unirl.backends.megatron.moe.router_stages`). ``replay``: routing replay of
        ``mb.routed_experts`` and ``router/disagreement`` per microbatch."""
        # the caller's interface refused an empty list (`unirl.backends.base`, core's plan)
        assert microbatches, "a training pass needs at least one microbatch"
        if model.grads_pending:
            raise RuntimeError(
                "forward_backward called twice without optimizer_step: megatron's schedule "
                "reduces the gradients at the end of each call; pass all microbatches of one "
                "optimizer step in one call"
            )
        items, rows, seq_len = self._items(microbatches)
        scale = self.loss_scale(len(items))
        metrics: dict[int, Mapping[str, Metric]] = {}
        assert not (router_logits and self.topology.pp_size > 1), "pp > 1: stage_router"
        stages = None
        if stage_router is not None:
            stages = self._stage_router_losses(model, stage_router, microbatches, len(items))

        stage_loss = self._train_stage_loss(
            model,
            loss_fn,
            spec,
            progress,
            router_logits=router_logits,
            scale=scale,
            metrics=metrics,
        )
        for ddp in model.ddp:
            ddp.train()
        model.grads_pending = True
        self._run(
            model,
            items,
            rows,
            seq_len,
            stage_loss,
            on_forward,
            progress,
            train=True,
            stage_output=_chain(
                None if replay is None else replay.after_forward,
                None if stages is None else stages.stage_output,
            ),
            before_forward=None if replay is None else replay.before_forward,
        )
        # logits nobody took (no router losses: a critic, megatron's recompute recording in the
        # backward) are dropped, not kept across steps
        collect_router_logits(model.chunks)
        self._add_stage_metrics(metrics, stages, replay, len(microbatches))
        return self._in_order(metrics, len(microbatches))

    @staticmethod
    def _train_stage_loss(
        model: MegatronModel,
        loss_fn: HeadLossFn,
        spec: LogprobSpec | None,
        progress: MicrobatchProgress,
        *,
        router_logits: bool,
        scale: float,
        metrics: dict[int, Mapping[str, Metric]],
    ) -> _StageLoss:
        """The last stage's loss of one training microbatch, times ``scale``; its metrics go
        into ``metrics`` by the microbatch's index."""

        def stage_loss(item: ScheduledMicrobatch, output: torch.Tensor) -> tuple[torch.Tensor, Any]:
            # output: the last stage's logits, hidden states (fused head) or values
            if item.mb is None:  # VPP padding: a zero that still reaches every parameter
                return zero_through_graph(output), {}
            mb = item.mb
            mb_loss_fn = loss_fn
            if router_logits:  # core adds the router losses from this forward's logits
                mb_loss_fn = functools.partial(
                    loss_fn, router_logits=microbatch_router_logits(model.chunks, item.batch)
                )
            loss, mb_metrics = model.head.loss(model.chunks, item, output, spec, mb_loss_fn)
            if mb.num_tokens == 0:
                # the backward (and the pipeline's gradient sends) run as for any microbatch
                loss = loss + zero_through_graph(output)
            metrics[item.index] = mb_metrics
            progress.report(loss=loss.detach(), tokens=mb.num_tokens)
            return loss * scale, {}

        return stage_loss

    def _add_stage_metrics(
        self,
        metrics: dict[int, Mapping[str, Metric]],
        stages: StageRouterLosses | None,
        replay: ScheduleReplay | None,
        num_microbatches: int,
    ) -> None:
        """The pipeline stages' router-loss metrics and routing replay's disagreement, added to
        the last stage's metrics of each microbatch (every rank joins the disagreement's
        reduction)."""
        last = self.topology.is_last_pipeline_stage()
        if stages is not None and last:
            for index, router_metrics in stages.metrics().items():
                metrics[index] = {**metrics[index], **router_metrics}
        if replay is not None:
            disagreement = replay.disagreement(num_microbatches, self.device)
            if last:
                for index, metric in enumerate(disagreement):
                    metrics[index] = with_disagreement(dict(metrics[index]), metric)

    def _stage_router_losses(
        self,
        model: MegatronModel,
        router: RouterLossSettings,
        microbatches: Sequence[TrainMicrobatch],
        num_items: int,
    ) -> StageRouterLosses:
        """Under pp > 1: the shares' backward scaled as megatron scales the last stage's loss
        (its grad scale, ``cp / num_microbatches``, times `loss_scale`), weighted by the step's
        tokens (summed over the data-parallel ranks: every rank of the step is in this call)."""
        topo = self.topology
        tokens = torch.tensor(
            [sum(mb.num_tokens for mb in microbatches)], dtype=torch.int64, device=self.device
        )
        if topo.groups.dp is not None and topo.dp_size > 1:
            torch.distributed.all_reduce(tokens, group=topo.groups.dp)
        config = model.chunks[0].config
        grad_scale = 1.0
        if config.grad_scale_func is not None:
            grad_scale = float(config.grad_scale_func(torch.ones(1, device=self.device)))
        return StageRouterLosses(
            router,
            pp_group=topo.groups.pp,
            num_local_chunks=len(model.chunks),
            backward_scale=grad_scale * self.loss_scale(num_items) * topo.cp_size / num_items,
            global_tokens=int(tokens),
        )

    def _items(
        self, microbatches: Sequence[TrainMicrobatch]
    ) -> tuple[list[ScheduledMicrobatch], int, int]:
        return schedule_items(
            microbatches,
            self.topology,
            self.device,
            packed=self.packed,
            seq_multiple=self.seq_multiple,
        )

    def _run(
        self,
        model: MegatronModel,
        items: Sequence[ScheduledMicrobatch],
        rows: int,
        seq_len: int,
        stage_loss: _StageLoss,
        on_forward: Callable[[], None],
        progress: MicrobatchProgress,
        *,
        train: bool,
        stage_output: StageOutput | None = None,
        before_forward: Callable[[ScheduledMicrobatch, torch.nn.Module], None] | None = None,
    ) -> None:
        run_schedule(
            model.modules,
            items,
            rows=rows,
            seq_len=seq_len,
            loss_func=stage_loss,
            forward_only=not train,
            topology=self.topology,
            on_forward=on_forward,
            on_microbatch=progress.tick,
            stage_output=stage_output,
            before_forward=before_forward,
        )

    def _in_order(self, results: Mapping[int, Any], n: int) -> list[Any]:
        if not self.topology.is_last_pipeline_stage():
            return []
        return [results[i] for i in range(n)]


def _chain(*hooks: StageOutput | None) -> StageOutput | None:
    """The given `StageOutput` hooks applied in order (None if there are none)."""
    given = [h for h in hooks if h is not None]
    if not given:
        return None

    def chained(
        index: int, mb: Any, batch: Any, chunk: torch.nn.Module, vp: Any, output: torch.Tensor
    ) -> torch.Tensor:
        for hook in given:
            output = hook(index, mb, batch, chunk, vp, output)
        return output

    return chained
