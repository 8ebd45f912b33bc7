"""Routing replay on the Megatron backend (``algorithm.routing_replay``): one schedule call's
routers replaying ``mb.routed_experts`` (R3 in every policy pass, R2 in the training passes) and
counting disagreement, or recording their free top-k (R2, the policy's forward-only pass).

Mapping (the traps of megatron-core 0.16.1's own `RouterReplay` do not apply: the replay is
`RecordingTopKRouter`'s, keyed by each router's global layer number, not by construction order):
before each chunk's forward (`schedule.run_schedule`'s ``before_forward``) every router of the
chunk gets its MoE layer's column of the microbatch's experts, in the router's row order
(`moe.stream_experts`: the packed stream with `FREE` at megatron's padding, or right-padded
rows sequence-major), so pipeline stages, virtual stages and expert-parallel ranks each replay
exactly their own layers; after the forward (``stage_output``) the chunk's disagreement counts
and recorded indices are filed under the microbatch. After the schedule the counts are summed
over the pipeline stages (one all-reduce, every stage reaches it) for ``router/disagreement`` on
the last stage, and recorded indices are gathered over the pipeline group into
``[T, moe_layers, top_k]`` per microbatch (the microbatch's real tokens, packed order).

Under sequence parallel (``parallel.sequence_parallel``, tp > 1) each TP rank's router sees its
own contiguous slice of the router's rows (megatron splits ``[S, B]`` along ``S``; flattened
sequence-major, rank ``r`` holds rows ``r * n / tp`` to ``(r + 1) * n / tp``): it replays that
slice of the experts (`ScheduleReplay.local_rows`), its counts are summed over the TP group as
well, and the slices it records are gathered over the TP group (rank order) before the
microbatch's rows are picked.

Not with megatron's full activation recompute: the recompute reruns a router in the backward,
after later microbatches set their own experts (the plug-in's check refuses it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from unirl.backends.megatron.moe.layers import moe_layer_index, routers, stream_experts
from unirl.backends.megatron.padded import PaddedBatch
from unirl.backends.megatron.schedule import ScheduledMicrobatch
from unirl.core.data.routed_experts import DTYPE
from unirl.core.maths.losses import Metric
from unirl.core.maths.losses.router_disagreement import (
    ROUTER_DISAGREEMENT,
    router_disagreement_metric,
)
from unirl.core.topology import Topology


class ScheduleReplay:
    """Replay and / or record for one schedule call over ``chunks`` (see the module docstring)."""

    def __init__(
        self,
        chunks: Sequence[torch.nn.Module],
        hf_config: Any,
        topology: Topology,
        *,
        record: bool,
    ) -> None:
        self.routers = routers(chunks)
        self.hf_config = hf_config
        self.topology = topology
        self.record = record
        # every router of a model shares one TransformerConfig
        self.split = bool(self.routers) and bool(self.routers[0].config.sequence_parallel)
        self.counts: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.recorded: dict[int, dict[int, torch.Tensor]] = {}
        self.batches: dict[int, Any] = {}
        for router in self.routers:
            router.record_indices = record
            router.recorded_indices = []
            router.replay_counts = []

    def before_forward(self, item: ScheduledMicrobatch, chunk: torch.nn.Module) -> None:
        experts = None if item.mb is None else item.mb.routed_experts
        stream = None if experts is None else stream_experts(experts, item.batch)
        for router in routers([chunk]):
            column = moe_layer_index(self.hf_config, router.layer_number)
            router.replay_experts = None if stream is None else self.local_rows(stream[:, column])

    def local_rows(self, rows_nk: torch.Tensor) -> torch.Tensor:
        """The rows of ``rows_nk`` (the router's rows of the whole microbatch) this rank's router
        sees: all of them, or under sequence parallel this TP rank's slice."""
        if not self.split:
            return rows_nk
        tp, rank = self.topology.tp_size, self.topology.tp_rank
        # the model input is padded to a multiple of tp (`sequence_parallel.sequence_multiple`)
        assert rows_nk.shape[0] % tp == 0, (rows_nk.shape, tp)
        size = rows_nk.shape[0] // tp
        return rows_nk[rank * size : (rank + 1) * size]

    def after_forward(
        self, index: int, mb: Any, batch: Any, chunk: torch.nn.Module, vp_stage: Any, output: Any
    ) -> Any:
        """`schedule.StageOutput`: files the chunk's counts and indices; the output unchanged."""
        for router in routers([chunk]):
            router.replay_experts = None
            counts, router.replay_counts = router.replay_counts, []
            indices, router.recorded_indices = router.recorded_indices, []
            if mb is None:
                continue
            self.counts.setdefault(index, []).extend(counts)
            if indices:
                column = moe_layer_index(self.hf_config, router.layer_number)
                self.recorded.setdefault(index, {})[column] = indices[-1]
                self.batches[index] = batch
        return output

    def close(self) -> None:
        for router in self.routers:
            router.replay_experts = None
            router.record_indices = False
            router.recorded_indices = []
            router.replay_counts = []

    def disagreement(self, num_microbatches: int, device: torch.device) -> list[Metric]:
        """``router/disagreement`` per microbatch, counts summed over the pipeline stages (and
        the TP ranks' sequence slices under sequence parallel)."""
        counts = torch.zeros(num_microbatches, 2, dtype=torch.int64, device=device)
        for index, pairs in self.counts.items():
            for differing, decisions in pairs:
                counts[index, 0] += differing.to(device)
                counts[index, 1] += decisions.to(device)
        if self.split:
            dist.all_reduce(counts, group=self.topology.groups.tp)
        group = self.topology.groups.pp
        if group is not None and self.topology.pp_size > 1:
            dist.all_reduce(counts, group=group)
        return [router_disagreement_metric(c[0], c[1]) for c in counts]

    def recorded_routing(self, microbatches: Sequence[Any], num_moe_layers: int) -> list[Any]:
        """Per microbatch ``[T, moe_layers, top_k]`` int32 of the free top-k (every stage's
        layers gathered over the pipeline group, and the TP ranks' sequence slices under
        sequence parallel), in the microbatch's packed token order."""
        recorded = self._whole_rows()
        mine = {
            index: {
                column: _real_rows(t, self.batches[index], mb.num_tokens).cpu()
                for column, t in layers.items()
            }
            for index, layers in recorded.items()
            for mb in (microbatches[index],)
        }
        group = self.topology.groups.pp
        parts = [mine]
        if group is not None and self.topology.pp_size > 1:
            parts = [None] * self.topology.pp_size
            dist.all_gather_object(parts, mine, group=group)
        out = []
        for index in range(len(microbatches)):
            layers = {c: t for part in parts for c, t in part.get(index, {}).items()}
            missing = sorted(set(range(num_moe_layers)) - set(layers))
            if missing:
                raise RuntimeError(f"routing record: MoE layers {missing} did not run")
            out.append(torch.stack([layers[c] for c in range(num_moe_layers)], dim=1).to(DTYPE))
        return out

    def _whole_rows(self) -> dict[int, dict[int, torch.Tensor]]:
        """The recorded indices of every router row of each microbatch: this rank's, or under
        sequence parallel the TP ranks' slices concatenated in rank order (collective over TP)."""
        if not self.split:
            return self.recorded
        local = {i: {c: t.cpu() for c, t in layers.items()} for i, layers in self.recorded.items()}
        parts: list[Any] = [None] * self.topology.tp_size
        dist.all_gather_object(parts, local, group=self.topology.groups.tp)
        return {
            index: {column: torch.cat([p[index][column] for p in parts]) for column in layers}
            for index, layers in local.items()
        }


def _real_rows(indices_nk: torch.Tensor, batch: Any, num_tokens: int) -> torch.Tensor:
    """The router's rows of the microbatch's own tokens, in packed order."""
    if isinstance(batch, PaddedBatch):
        rows, length = batch.tokens.shape
        batch_first = (
            indices_nk.reshape(length, rows, -1).transpose(0, 1).reshape(rows * length, -1)
        )
        return batch_first.index_select(0, batch.flat_index.to(indices_nk.device))
    return indices_nk[:num_tokens]


def with_disagreement(metrics: dict[str, Metric], metric: Metric) -> dict[str, Metric]:
    return {**metrics, ROUTER_DISAGREEMENT: metric}
