"""A Megatron policy's weights as a stream of buckets of Hugging Face tensors
(`unirl.core.weight_stream`), made on the pipeline stage that owns them.

Each stage converts its own layers (`convert.stage_hf_tensors`: TP shards, and expert shards
over the expert-parallel group, all-gathered one parameter at a time) and fills buckets on the
device. The stages then take turns in pipeline order: the owning stage broadcasts each bucket
(its names and shapes, then its tensors) over the pipeline group, and the receiving rank copies
it to the CPU. Pipeline groups without a receiving rank only run their stage's gathers (their TP
peers need them). So a rank holds its shards, one gathered parameter and one bucket; nothing
holds the model. Names, values and dtypes are those of `convert.export_hf_state_dict`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from unirl.backends.megatron.convert import check_export_names, chunk_entries, stage_hf_tensors
from unirl.core.topology import Topology
from unirl.core.weight_stream import (
    Bucket,
    WeightBuckets,
    agree_non_finite,
    bucketed,
    checked_stream,
    first_non_finite_local,
    receives,
)


def non_finite_weight(chunks: Sequence[torch.nn.Module], hf_config: Any) -> str | None:
    """The first non-finite parameter, named by its HF tensor(s) (local shards, one all-reduce)."""
    local = None
    for chunk in chunks:
        params = dict(chunk.named_parameters())
        for entry in chunk_entries(chunk, hf_config):
            if first_non_finite_local([("", params[entry.megatron_name].detach())]) is not None:
                local = f"{' / '.join(entry.hf_names)} (Megatron {entry.megatron_name})"
                break
        if local is not None:
            break
    device = next(chunks[0].parameters()).device
    return agree_non_finite(local, device)


def _host(bucket: Bucket) -> Bucket:
    return [(n, torch.empty(t.shape, dtype=t.dtype, device="cpu").copy_(t)) for n, t in bucket]


def _pipeline_buckets(
    local: Iterator[Bucket], topology: Topology, device: torch.device, keep: bool
) -> WeightBuckets:
    """Every stage's buckets in stage order, broadcast over the pipeline group."""
    group = topology.groups.pp
    for stage in range(topology.pp_size):
        src = dist.get_global_rank(group, stage)
        own = stage == topology.pp_rank
        while True:
            bucket = next(local, None) if own else None
            box: list[Any] = [
                None if bucket is None else [(n, tuple(t.shape), t.dtype) for n, t in bucket]
            ]
            dist.broadcast_object_list(box, src=src, group=group, device=device)
            meta = box[0]
            if meta is None:
                break
            if own:
                assert bucket is not None
                tensors = [t.contiguous() for _, t in bucket]
            else:
                tensors = [torch.empty(s, dtype=d, device=device) for _, s, d in meta]
            for t in tensors:
                dist.broadcast(t, src=src, group=group)
            if keep:
                yield _host([(m[0], t) for m, t in zip(meta, tensors)])
            del bucket, tensors


def stream_weights(
    chunks: Sequence[torch.nn.Module],
    hf_config: Any,
    topology: Topology,
    bucket_bytes: int,
    *,
    dst: int | None,
) -> WeightBuckets:
    """See `unirl.core.backend.TrainingBackend.stream_weights`."""
    keep = receives(dst)
    device = next(chunks[0].parameters()).device

    def make() -> WeightBuckets:
        local = bucketed(stage_hf_tensors(chunks, hf_config, topology), bucket_bytes)
        pipeline = topology.pp_size > 1 and (
            dst is None or dst in dist.get_process_group_ranks(topology.groups.pp)
        )
        names: set[str] = set()
        if pipeline:
            buckets = _pipeline_buckets(local, topology, device, keep)
        else:
            buckets = (_host(b) if keep else [] for b in local)
        for bucket in buckets:
            if keep:
                names.update(n for n, _ in bucket)
                yield bucket
        if keep:
            check_export_names(names, hf_config)

    return checked_stream(lambda: non_finite_weight(chunks, hf_config), make)
