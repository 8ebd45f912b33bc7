"""One call of megatron-core's pipeline schedule over a list of microbatches.

`get_forward_backward_func()` picks the schedule for the layout: no pipelining, 1F1B, or
interleaved 1F1B under virtual pipeline stages (VPP), where the forward-step function runs once
per model chunk per microbatch. The forward step here:

- reads the next `ScheduledMicrobatch` from its chunk's iterator (every chunk sees every
  microbatch in order; the iterator knows its chunk's ``vp_stage``),
- runs the chunk on the microbatch's model inputs: the packed token stream with its
  `PackedSeqParams` (`unirl.backends.megatron.packed`, the default) or right-padded rows
  (`unirl.backends.megatron.padded`, ``megatron.attention: padded | unfused``),
- counts one model forward per microbatch (on chunk 0) and, after it returns, ticks the progress
  bar once per microbatch: only where `Topology.counts_microbatch(vp_stage)` (the last chunk of
  the last stage),
- returns a loss function that megatron calls on the last stage only.

Megatron's averaging, and the one factor that cancels it. A loss function returning ``(loss,
data)`` has its loss multiplied by the context-parallel size and divided by ``num_microbatches``
(megatron-core 0.16.1, ``forward_step_calc_loss``), and DDP then scales gradients by ``1 / (dp *
cp)`` before summing them over the data-with-context-parallel group. Core losses are globally
normalised (their SUM over microbatches and ranks is the objective), so each microbatch's loss is
multiplied by ``num_microbatches * dp`` (`loss_scale`): ``cp / (n * dp * cp) * n * dp = 1``.

Under VPP megatron runs the microbatches in groups of ``microbatch_group_size_per_vp_stage``
(default ``pp``) per chunk and needs ``pp <= group <= M`` with ``M % group`` either 0 or at
least ``pp``. `vpp_group_size` picks the smallest group that fits ``M`` (memory grows with the
group); only a call with fewer than ``pp`` microbatches is padded, with empty microbatches that
count for nothing (no loss, no progress tick, no forward count, no result) but still run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist

from unirl.backends.megatron.packed import PackedBatch, schedule_stream_tokens, to_packed_batch
from unirl.backends.megatron.padded import PaddedBatch, empty_padded, padded_shape, to_padded
from unirl.backends.microbatch import to_device
from unirl.core.config.run_config import ParallelConfig
from unirl.core.data.microbatch import TrainMicrobatch
from unirl.core.topology import Topology


def schedule_config(parallel: ParallelConfig) -> dict[str, Any]:
    """TransformerConfig fields for the schedule.

    Interleaved 1F1B with two pipeline stages: each stage's previous and next stage are the same
    rank, and megatron's batched p2p (``batch_p2p_comm``, the default) posts a forward activation
    and a backward gradient of the same shape to that rank in an order the receiver does not
    mirror, so they can swap (measured on the CPU over gloo: training log-probs wrong, gradient
    norm 1500x too large, while forward-only passes were right). The unbatched path sends the
    two directions over two process groups, which keeps them apart.
    """
    if parallel.vpp is not None and parallel.vpp > 1 and parallel.pp == 2:
        return {"batch_p2p_comm": False}
    return {}


@attrs.frozen(kw_only=True)
class ScheduledMicrobatch:
    index: int  # position in the caller's list; -1 for padding
    batch: PackedBatch | PaddedBatch  # the model's inputs, on the device
    mb: TrainMicrobatch | None  # on the device; None for padding

    @property
    def is_pad(self) -> bool:
        return self.mb is None


class ChunkIterator(Iterator[ScheduledMicrobatch]):
    """The microbatches in order, for one model chunk (megatron takes one iterator per chunk)."""

    def __init__(self, items: Sequence[ScheduledMicrobatch], vp_stage: int | None) -> None:
        self._items = iter(items)
        self.vp_stage = vp_stage
        self.current: ScheduledMicrobatch | None = None

    def __next__(self) -> ScheduledMicrobatch:
        self.current = next(self._items)
        return self.current


def loss_scale(num_microbatches: int, topology: Topology) -> float:
    """The factor that cancels megatron's averaging (module docstring): ``n * dp``."""
    return float(num_microbatches * topology.dp_size)


def _agree(values: list[int], n: int, topology: Topology, device: torch.device) -> list[int]:
    """The MAX of ``values`` over the model-parallel ranks that exchange activations (they hold
    the same microbatches; the MAX makes a mismatch harmless), and a check that they run the
    same number ``n`` of microbatches (else the schedule would hang)."""
    group = _model_parallel_group(topology)
    if group is None:
        return values
    t = torch.tensor([*values, n, -n], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    if int(t[-2]) != -int(t[-1]):
        raise RuntimeError(
            f"tensor / pipeline-parallel ranks of one data-parallel rank got different "
            f"microbatch counts ({-int(t[-1])} to {int(t[-2])}); every rank of a data-parallel "
            "replica must be given the same microbatches"
        )
    return [int(x) for x in t[:-2]]


def _model_parallel_group(topology: Topology) -> Any:
    if topology.tp_size * topology.pp_size == 1:
        return None
    from megatron.core import parallel_state as ps

    return ps.get_model_parallel_group()


def schedule_items(
    microbatches: Sequence[TrainMicrobatch],
    topology: Topology,
    device: torch.device,
    *,
    packed: bool = True,
    seq_multiple: int = 1,
) -> tuple[list[ScheduledMicrobatch], int, int]:
    """The call's microbatches on the device as model inputs of one shape (and, under VPP, in
    sufficient number); returns ``(items, rows, seq_len)``: megatron's ``micro_batch_size`` and
    ``seq_length``.

    ``packed``: each microbatch is one token stream (``rows`` = 1) padded to the call's longest
    stream only under pipeline parallel (the stages exchange one activation shape; without PP
    each microbatch keeps its own length). Otherwise right-padded rows of the call's common
    ``(rows, L)``. ``seq_multiple``: every stream / row length is padded to a multiple of it
    (sequence parallel splits it evenly over the TP ranks: `sequence_parallel.sequence_multiple`;
    the padding is never read)."""
    n = len(microbatches)
    cp, cp_rank = topology.cp_size, topology.cp_rank
    if packed:
        pipelined = topology.pp_size > 1
        total = None
        if pipelined:
            longest = _round_up(schedule_stream_tokens(microbatches, cp), seq_multiple)
            (total,) = _agree([longest], n, topology, device)
        else:
            _agree([], n, topology, device)

        def own(mb: TrainMicrobatch) -> int | None:
            if total is not None or seq_multiple == 1:
                return total
            return _round_up(schedule_stream_tokens([mb], cp), seq_multiple)

        batches: list[PackedBatch | PaddedBatch] = [
            to_packed_batch(mb, cp_size=cp, cp_rank=cp_rank, device=device, total_tokens=own(mb))
            for mb in microbatches
        ]
        rows = 1
        seq_len = total if total is not None else max(b.schedule_tokens for b in batches)
    else:
        rows, length = padded_shape(microbatches)
        rows, seq_len = _agree([rows, _round_up(length, seq_multiple)], n, topology, device)
        batches = [to_padded(mb, rows, seq_len).to(device) for mb in microbatches]
    items = [
        ScheduledMicrobatch(index=i, batch=batch, mb=to_device(mb, device))
        for i, (mb, batch) in enumerate(zip(microbatches, batches))
    ]
    if topology.vpp_size is not None and topology.vpp_size > 1 and len(items) < topology.pp_size:
        if packed:
            empty = attrs.evolve(
                microbatches[0],
                tokens=torch.zeros(0, dtype=torch.long),
                cu_seqlens=torch.zeros(1, dtype=torch.int32),
                global_cu_seqlens=torch.zeros(1, dtype=torch.int32),
            )
            pad: PackedBatch | PaddedBatch = to_packed_batch(
                empty, cp_size=cp, cp_rank=cp_rank, device=device, total_tokens=seq_len
            )
        else:
            pad = empty_padded(rows, seq_len).to(device)
        items += [ScheduledMicrobatch(index=-1, batch=pad, mb=None)] * (topology.pp_size - n)
    return items, rows, seq_len


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def vpp_group_size(num_microbatches: int, pp: int) -> int:
    """The smallest ``g`` in ``[pp, M]`` with ``M % g == 0`` or ``M % g >= pp`` (megatron's
    interleaved-schedule constraint; ``g = M`` always fits)."""
    assert num_microbatches >= pp, (num_microbatches, pp)
    for g in range(pp, num_microbatches + 1):
        rest = num_microbatches % g
        if rest == 0 or rest >= pp:
            return g
    raise AssertionError("unreachable: g = M fits")


# (item, logits on the last stage: [1, T, V_local] packed, [rows, L, V_local] padded)
#   -> (loss tensor, data for megatron); item.batch.real_logits(logits) is [T_real, V_local]
LossFunc = Callable[[ScheduledMicrobatch, torch.Tensor], tuple[torch.Tensor, Any]]
# (microbatch index, microbatch or None for padding, model inputs, chunk, vp_stage, the chunk's
# output) -> the output megatron sends on / hands the loss function
StageOutput = Callable[
    [int, "TrainMicrobatch | None", Any, torch.nn.Module, "int | None", torch.Tensor], torch.Tensor
]


def run_schedule(
    model: Sequence[torch.nn.Module],
    items: Sequence[ScheduledMicrobatch],
    *,
    rows: int,
    seq_len: int,
    loss_func: LossFunc,
    forward_only: bool,
    topology: Topology,
    on_forward: Callable[[], None],
    on_microbatch: Callable[[], None],
    stage_output: StageOutput | None = None,
    before_forward: Callable[[ScheduledMicrobatch, torch.nn.Module], None] | None = None,
) -> None:
    """One schedule call. `on_forward` runs once per real microbatch (after chunk 0's forward),
    `on_microbatch` once per real microbatch where the microbatch completes (progress tick),
    `stage_output` (if given) on every chunk's output before megatron sees it (the router
    losses' stage shares, `unirl.backends.megatron.moe.router_stages`), `before_forward` (if given)
    before each chunk's forward (routing replay sets the routers' experts)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    vpp = topology.vpp_size is not None and topology.vpp_size > 1
    if vpp:
        group = vpp_group_size(len(items), topology.pp_size)
        for chunk in model:
            chunk.config.microbatch_group_size_per_vp_stage = group
    iterators = [ChunkIterator(items, vp if vpp else None) for vp in range(len(model))]

    def forward_step(data_iterator: ChunkIterator, chunk: torch.nn.Module) -> Any:
        item = next(data_iterator)
        if before_forward is not None:
            before_forward(item, chunk)
        output = chunk(**item.batch.model_kwargs())
        if stage_output is not None:
            output = stage_output(
                item.index, item.mb, item.batch, chunk, data_iterator.vp_stage, output
            )
        if not item.is_pad:
            if data_iterator.vp_stage in (None, 0):
                on_forward()
            if topology.counts_microbatch(data_iterator.vp_stage):
                on_microbatch()
        return output, functools.partial(loss_func, item)

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if vpp else iterators[0],
        model=list(model) if vpp else model[0],
        num_microbatches=len(items),
        seq_length=seq_len,
        micro_batch_size=rows,
        forward_only=forward_only,
    )
