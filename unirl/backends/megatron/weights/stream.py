"""A Megatron policy's weights as a stream of buckets of Hugging Face tensors
(`unirl.core.weights.stream`), made on the pipeline stage that owns them.

Each stage converts its own layers one Megatron parameter at a time (TP shards, and expert
shards over the expert-parallel group, all-gathered; a fused qkv / gate-up split into its HF
tensors), copying each HF tensor into its place in a bucket planned from the shapes beforehand
(`unirl.core.weights.stream.planned_buckets`), on the ``device`` the consumer asks for (the GPU
for the IPC / NCCL transports, the host for the file transport). A vocabulary-parallel embedding
or head, the largest tensors, is all-gathered in one piece (rows in rank order), straight into
its bucket slot when the slot is on the parameter's device. With pipeline stages, the stages
then take turns in pipeline order: the owning stage broadcasts each bucket over the pipeline
group, its tensors' specs and then its flat buffer, and the receiving rank takes it
into a bucket of the same layout (`unirl.core.weights.stream.FlatBucket`), on the trainer's device
(which the pipeline group broadcasts on); a receiving rank that asked for the host copies it
there. Pipeline groups without a receiving rank only run their stage's gathers (their TP peers
need them). A sending stage that fails (an error while making its bucket, a bucket that is not
flat) says so in the object broadcast instead of the specs, and every rank of the group raises
the same error: none is left waiting in a broadcast. So a rank holds its shards, one gathered
parameter and one bucket (two, device and host, when a GPU trainer streams to the host under
pipeline stages); nothing holds the model.
Names, values and dtypes are those of `convert.export_hf_state_dict`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist

from unirl.backends.megatron.weights.hf_layout import (
    Entry,
    ParamsOf,
    _all_gather,
    _expert_parallel_entries,
    _hf_tensors,
    check_export_names,
    chunk_entries,
    own_parameters,
)
from unirl.core.topology import Topology
from unirl.core.weights.stream import (
    Bucket,
    FlatBucket,
    TensorSpec,
    WeightBuckets,
    agree_non_finite,
    checked_stream,
    first_non_finite_local,
    flat_buffer,
    gather_rows,
    planned_buckets,
    receives,
    same_device,
    spec_of,
)

# (tensor, group size, group) -> the group's tensors in rank order
Gather = Callable[[torch.Tensor, int, Any], list[torch.Tensor]]


def non_finite_weight(
    chunks: Sequence[torch.nn.Module], hf_config: Any, params_of: ParamsOf = own_parameters
) -> str | None:
    """The first non-finite parameter, named by its HF tensor(s) (local shards, one all-reduce)."""
    local = None
    for index, chunk in enumerate(chunks):
        params = params_of(index, chunk)
        for entry in chunk_entries(chunk, hf_config):
            if first_non_finite_local([("", params[entry.megatron_name].detach())]) is not None:
                local = f"{' / '.join(entry.hf_names)} (Megatron {entry.megatron_name})"
                break
        if local is not None:
            break
    device = next(chunks[0].parameters()).device
    return agree_non_finite(local, device)


@attrs.frozen(eq=False)
class _Unit:
    """One Megatron parameter of this stage and its conversion entry."""

    entry: Entry
    param: torch.Tensor


def _units(
    chunks: Sequence[torch.nn.Module], hf_config: Any, params_of: ParamsOf
) -> Iterator[_Unit]:
    for index, chunk in enumerate(chunks):
        params = params_of(index, chunk)
        for entry in chunk_entries(chunk, hf_config):
            if entry.megatron_name == "output_layer.weight" and hf_config.tie_word_embeddings:
                continue  # the first stage's embedding is the one copy HF keeps
            yield _Unit(entry, params[entry.megatron_name].detach())


def _hf_of(
    unit: _Unit, topology: Topology, hf_config: Any, gather: Gather
) -> list[tuple[str, torch.Tensor]]:
    """`convert.stage_hf_tensors` for one parameter, gathered by ``gather``."""
    entry, param = unit.entry, unit.param
    if entry.expert is None:
        shards = gather(param, topology.tp_size, topology.groups.tp)
        return list(_hf_tensors(entry, shards, hf_config))
    # a routed expert: each expert-parallel rank holds another expert in this slot
    dim = int(entry.kind == "row")
    whole = torch.cat(gather(param, topology.etp_size, topology.groups.etp), dim=dim)
    out: list[tuple[str, torch.Tensor]] = []
    per_ep_rank = gather(whole, topology.ep_size, topology.groups.ep)
    for ep_entry, tensor in zip(_expert_parallel_entries(entry, topology), per_ep_rank):
        out.extend(_hf_tensors(ep_entry, list(tensor.chunk(topology.etp_size, dim=dim)), hf_config))
    return out


def _gather(t: torch.Tensor, size: int, group: Any) -> list[torch.Tensor]:
    """`convert._all_gather`; on the CPU the shards land in one buffer, a broadcast per rank
    (`unirl.core.weights.stream.gather_rows`: no staging buffer of gloo's, no list of separate
    allocations for the heap to keep)."""
    if size == 1 or t.device.type != "cpu":
        return _all_gather(t, size, group)
    stacked = t.new_empty((size, *t.shape))
    gather_rows(stacked, t, group)
    return list(stacked.unbind(0))


def _on_meta(t: torch.Tensor, size: int, group: Any) -> list[torch.Tensor]:
    return [torch.empty_like(t, device="meta") for _ in range(size)]


def _specs(unit: _Unit, topology: Topology, hf_config: Any) -> list[TensorSpec]:
    """The HF tensors ``unit`` makes, from the conversion run on meta tensors (no gather)."""
    return [
        TensorSpec(n, tuple(t.shape), t.dtype)
        for n, t in _hf_of(unit, topology, hf_config, _on_meta)
    ]


def _maker(topology: Topology, hf_config: Any) -> Any:
    def make(unit: _Unit, out: torch.Tensor | None) -> Sequence[torch.Tensor]:
        param, entry = unit.param, unit.entry
        if entry.kind == "vocab" and entry.expert is None and topology.tp_size == 1:
            # the rows HF keeps, as a view: the conversion's cat of the one shard would copy
            # the largest tensor (1 GiB at 7B) beside its bucket; the bucket copies it in
            return [param[: hf_config.vocab_size]]
        if entry.kind == "vocab" and entry.expert is None:
            # the largest tensors: one all-gather (rows in rank order), no list of shards + cat
            rows = param.shape[0] * topology.tp_size
            direct = (
                out is not None
                and same_device(out.device, param.device)
                and out.dtype == param.dtype
                and out.shape[0] == rows
            )
            full = out if direct else param.new_empty((rows, *param.shape[1:]))
            assert full is not None
            gather_rows(full, param, topology.groups.tp)
            return [full if direct else full[: hf_config.vocab_size]]
        return [t for _, t in _hf_of(unit, topology, hf_config, _gather)]

    return make


def _moved(specs: Sequence[TensorSpec], bucket: Bucket, device: torch.device) -> Bucket:
    """``bucket`` copied into a bucket of the same layout on ``device``."""
    moved = FlatBucket(specs, device)
    for slot, (_, t) in zip(moved.slots, bucket):
        slot.copy_(t)
    return moved.tensors()


@attrs.frozen
class _StageFailed:
    """The sending stage's failure, broadcast in place of a bucket's specs."""

    message: str


@attrs.frozen(eq=False)
class _Next:
    """What this stage sends next. ``header`` goes in the object broadcast: the bucket's specs,
    ``None`` at the end, or a `_StageFailed`; ``cause``: the local error behind the latter."""

    header: Any
    bucket: Bucket | None = None
    buffer: torch.Tensor | None = None
    cause: BaseException | None = None


def _next_to_send(mine: Iterator[Bucket] | None, stage: int) -> _Next:
    """This stage's next bucket and its flat buffer, or why there is none. A failure of the
    sending stage (its bucket not flat, an error while making it) travels in the object that
    every rank of the group receives anyway, so each raises it instead of waiting in the
    buffer's broadcast (or the next bucket's) for a rank that already left."""
    if mine is None:
        return _Next(header=None)
    try:
        bucket = next(mine, None)
    except Exception as err:  # re-raised on every rank, this one included
        failed = _StageFailed(f"pipeline stage {stage} failed: {type(err).__name__}: {err}")
        return _Next(header=failed, cause=err)
    if bucket is None:
        return _Next(header=None)
    buffer = flat_buffer(bucket)
    if buffer is None:
        return _Next(
            header=_StageFailed(
                f"pipeline stage {stage}'s bucket of {len(bucket)} tensors is not one flat "
                "buffer, so it cannot be broadcast as one; "
                "planned_buckets makes flat buckets: the stage's buckets came from elsewhere"
            )
        )
    return _Next(header=[spec_of(n, t) for n, t in bucket], bucket=bucket, buffer=buffer)


def _pipeline_buckets(
    local: Callable[[torch.device], WeightBuckets],
    topology: Topology,
    transit: torch.device,
    keep: bool,
    device: torch.device,
    dst: int | None,
) -> WeightBuckets:
    """Every stage's buckets in stage order, each one sent (its flat buffer) from its stage to
    the receiving rank ``dst`` (point to point: no other stage needs it), or broadcast over the
    pipeline group when every rank receives (``dst`` None); ``local(where)``: this stage's
    buckets, made on ``where``. ``transit``: the trainer's device, which the group communicates
    on; kept buckets end on ``device``. A failure of the stage that sends raises the same error
    on every rank that waits for it."""
    group = topology.groups.pp
    here = device if keep and same_device(device, transit) else transit
    me = dist.get_rank()
    for stage in range(topology.pp_size):
        src = dist.get_global_rank(group, stage)
        if dst is not None and me not in (src, dst):
            continue  # this stage's buckets go from src to dst only
        mine = local(here) if stage == topology.pp_rank else None
        if dst == src:  # the receiving rank's own stage: its buckets are already here
            for bucket in mine or ():
                yield _moved_if(bucket, here, device) if keep else bucket
            continue
        yield from _transfer(mine, stage, src, dst, group, transit, here, keep, device)


def _moved_if(bucket: Bucket, here: torch.device, device: torch.device) -> Bucket:
    if same_device(here, device):
        return bucket
    return _moved([spec_of(n, t) for n, t in bucket], bucket, device)


def _transfer(
    mine: Iterator[Bucket] | None,
    stage: int,
    src: int,
    dst: int | None,
    group: Any,
    transit: torch.device,
    here: torch.device,
    keep: bool,
    device: torch.device,
) -> WeightBuckets:
    """One stage's buckets from ``src``: broadcast over ``group`` (``dst`` None) or sent to
    ``dst``; each header (the specs, None at the end, or the stage's failure) first."""
    while True:
        sent = _next_to_send(mine, stage)
        bucket, buffer, cause = sent.bucket, sent.buffer, sent.cause
        box: list[Any] = [sent.header]
        del sent
        if dst is None:
            dist.broadcast_object_list(box, src=src, group=group, device=transit)
        elif mine is not None:
            dist.send_object_list(box, dst=dst, group=group, device=transit)
        else:
            dist.recv_object_list(box, src=src, group=group, device=transit)
        specs = box[0]
        if isinstance(specs, _StageFailed):  # every rank that waits, no one left waiting
            raise RuntimeError(f"weight stream: {specs.message}") from cause
        if specs is None:
            return
        if buffer is None:  # the same layout as the stage's, from the same specs
            received = FlatBucket(specs, here)
            buffer, bucket = received.buffer, received.tensors()
            del received
        if dst is None:
            dist.broadcast(buffer, src=src, group=group)
        elif mine is not None:
            dist.send(buffer, dst=dst, group=group)
        else:
            dist.recv(buffer, src=src, group=group)
        del buffer
        if keep and not same_device(here, device):
            bucket = _moved(specs, bucket, device)  # the GPU bucket is dropped here
        if keep:
            yield bucket
        del bucket


def _replica_receives(topology: Topology, dst: int, device: torch.device) -> bool:
    """Whether ``dst`` is a rank of this model replica (its tp x pp ranks): ``dst`` is in the
    tensor-parallel group of some stage of this rank's pipeline group. One small all-reduce over
    the pipeline group; every rank of a replica gets the same answer."""
    tp_ranks = (
        dist.get_process_group_ranks(topology.groups.tp)
        if topology.groups.tp is not None
        else [dist.get_rank()]
    )
    flag = torch.tensor([int(dst in tp_ranks)], device=device)
    if topology.groups.pp is not None:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=topology.groups.pp)
    return bool(flag.item())


def stream_weights(
    chunks: Sequence[torch.nn.Module],
    hf_config: Any,
    topology: Topology,
    bucket_bytes: int,
    *,
    dst: int | None,
    device: torch.device,
    params_of: ParamsOf = own_parameters,
) -> WeightBuckets:
    """See `unirl.core.backend.TrainingBackend.stream_weights`; ``params_of``: the weights as
    read (under LoRA the merged ones)."""
    keep = receives(dst)
    transit = next(chunks[0].parameters()).device

    def stage(keep_here: bool, where: torch.device) -> WeightBuckets:
        return planned_buckets(
            _units(chunks, hf_config, params_of),
            lambda u: _specs(u, topology, hf_config),
            _maker(topology, hf_config),
            bucket_bytes,
            keep=keep_here,
            device=where,
        )

    def make() -> WeightBuckets:
        if (
            dst is not None
            and topology.ep_size == 1
            and dist.is_initialized()
            and not _replica_receives(topology, dst, transit)
        ):
            return  # a replica without the receiving rank: nobody needs its gathers
        pipeline = topology.pp_size > 1 and (
            dst is None or dst in dist.get_process_group_ranks(topology.groups.pp)
        )
        names: set[str] = set()
        if pipeline:
            buckets = _pipeline_buckets(
                lambda where: stage(True, where), topology, transit, keep, device, dst
            )
        else:
            buckets = stage(keep, device)
        for bucket in buckets:
            if keep:
                names.update(n for n, _ in bucket)
                yield bucket
            del bucket
        if keep:
            check_export_names(names, hf_config)

    return checked_stream(lambda: non_finite_weight(chunks, hf_config, params_of), make)
