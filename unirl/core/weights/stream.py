"""The policy's weights on their way to a rollout source: Hugging Face-named tensors in buckets,
made by the ranks that own them, so that no rank ever holds the whole model for a sync.

    buckets = backend.stream_weights(bucket_bytes, dst=0, device=d)  # collective; refuses
    for bucket in buckets:                                           # non-finite weights; every
        for name, tensor in bucket:                                  # rank iterates to the end
            ...                                                      # tensors on ``d`` (dst)

A bucket holds at most ``bucket_bytes`` unless a single tensor is larger (it then travels
alone). ``dst``: the global rank that receives (the one running the engine), or None for every
rank (a sampler on every rank). Ranks that do not receive iterate too (they take part in the
gathers) and get no buckets. ``device``: where the receiving rank's buckets live, the CPU
(`HOST`, the default: a file reload, a sampler) or the rank's GPU (the IPC / NCCL transports,
which then send each bucket's memory as it is: no copy through the host). Before the first bucket
is made, every rank scans its own shards for a NaN or an infinity and one all-reduce of a flag
decides: a non-finite model never reaches an engine (`NonFiniteWeightsError`, naming the first
such parameter).

Memory. A backend plans its buckets from the tensors' shapes before it gathers anything
(`planned_buckets`): each bucket is one flat buffer on ``device`` (`FlatBucket`, one allocation;
on the host glibc maps and unmaps it as a whole, so a freed bucket goes back to the OS instead of
staying in the heap), laid out as vLLM's packed weight transfer reads it (`packed_layout`, the
one layout function, which the transports check with `flat_buffer`), and each gathered parameter
is copied straight into its place in it (or all-gathered straight into it) and dropped. So a rank
holds its shards, the bucket being filled and one gathered parameter, never the next bucket's
tensors while the previous one is still held: about one bucket above the trainer's own memory,
on the GPU for ``device`` a GPU, on the host for the CPU. A consumer helps by dropping its bucket
before it asks for the next (``del bucket`` at the end of the loop body: a ``for`` loop's
variable keeps the previous bucket alive while the next one is being made). Tensors of one bucket
are views of one buffer: keeping any of them keeps the whole bucket.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import torch
import torch.distributed as dist

from unirl.core.errors import RunError

# One bucket: (Hugging Face name, tensor) pairs.
Bucket = list[tuple[str, torch.Tensor]]
WeightBuckets = Iterator[Bucket]

MIB = 1 << 20

# Where a stream's buckets live unless the consumer asks for its GPU: the one default of every
# backend's ``stream_weights(device=...)``.
HOST = torch.device("cpu")

# one unit of a backend's stream: what it gathers in one go (a parameter, a fused qkv)
U = TypeVar("U")


class NonFiniteWeightsError(RunError):
    """The policy's weights hold a NaN or an infinity (``parameter``: the first one found)."""

    def __init__(self, parameter: str) -> None:
        super().__init__(
            f"the policy weights are not finite (first in {parameter}); nothing was sent to the "
            "rollout source"
        )
        self.parameter = parameter


def bucketed(tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> WeightBuckets:
    """Group ``tensors`` (lazily, in order) into buckets of at most ``bucket_bytes``; a tensor
    larger than that is a bucket of its own."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    bucket: Bucket = []
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


@attrs.frozen
class TensorSpec:
    """A tensor a stream will hold, known before it is gathered."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * _element_size(self.dtype)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@attrs.frozen
class PackedLayout:
    """Where each tensor of a bucket lies in its one flat byte buffer."""

    order: tuple[int, ...]  # the tensors' indices in buffer order
    offsets: tuple[int, ...]  # each tensor's first byte, in the bucket's order
    nbytes: int  # the buffer's size: the tensors' bytes, no padding


def packed_layout(specs: Sequence[TensorSpec]) -> PackedLayout:
    """The bytes of ``specs``' tensors back to back (each contiguous, row-major), widest element
    first and otherwise in bucket order: every offset is then a multiple of its tensor's element
    size (a bf16 tensor of odd length before a float32 one would break that), so each slice of
    the buffer can be viewed as its dtype. This is vLLM's packed layout (``pack_tensors``: the
    bytes in the order of the names it is sent); a `FlatBucket` is laid out by it and the
    transports pack by it, so a flat bucket is already the packed buffer."""
    order = tuple(sorted(range(len(specs)), key=lambda i: -_element_size(specs[i].dtype)))
    offsets = [0] * len(specs)
    total = 0
    for i in order:
        offsets[i] = total
        total += specs[i].nbytes
    return PackedLayout(order=order, offsets=tuple(offsets), nbytes=total)


class FlatBucket:
    """The tensors of one bucket as views of one flat uint8 buffer on ``device``, in ``specs``
    order, laid out by `packed_layout`."""

    def __init__(self, specs: Sequence[TensorSpec], device: torch.device | str = HOST) -> None:
        self.specs = list(specs)
        self.layout = packed_layout(self.specs)
        self.buffer = torch.empty(self.layout.nbytes, dtype=torch.uint8, device=device)
        self.slots = [
            self.buffer[o : o + s.nbytes].view(s.dtype).view(s.shape)
            for o, s in zip(self.layout.offsets, self.specs)
        ]

    def tensors(self) -> Bucket:
        return [(s.name, t) for s, t in zip(self.specs, self.slots)]


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, tuple(tensor.shape), tensor.dtype)


def flat_buffer(bucket: Bucket) -> torch.Tensor | None:
    """The one uint8 buffer that ``bucket``'s tensors are views of, when they lie in it exactly
    as `packed_layout` puts them (a `FlatBucket`'s tensors: a stream's buckets), else None (a
    state dict's separate tensors, `as_buckets`). The buffer shares the bucket's memory: no copy.
    Checked from the tensors themselves (one storage, its size, each tensor's place), so a
    bucket that is not laid out so is never sent as if it were."""
    if not bucket:
        return None
    storage = bucket[0][1].untyped_storage()
    layout = packed_layout([spec_of(n, t) for n, t in bucket])
    if storage.nbytes() != layout.nbytes:
        return None
    base = storage.data_ptr()
    for (_, t), offset in zip(bucket, layout.offsets):
        if not t.is_contiguous() or t.device != storage.device:
            return None
        if t.untyped_storage().data_ptr() != base:
            return None
        # the element offset, not data_ptr(): a tensor without elements has none
        if t.storage_offset() * t.element_size() != offset:
            return None
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether ``a`` and ``b`` are one device ("cuda" is the current GPU; any "cpu" the host:
    a tensor made on "cpu:0" is on "cpu")."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type == "cuda":
        return _cuda_index(a) == _cuda_index(b)
    return a.type == "cpu" or a.index == b.index


def _cuda_index(d: torch.device) -> int:
    return torch.cuda.current_device() if d.index is None else d.index


def _plan(
    units: Iterable[U], specs_of: Callable[[U], Sequence[TensorSpec]], bucket_bytes: int
) -> Iterator[list[tuple[U, int, int, TensorSpec]]]:
    """`bucketed` on shapes alone: per bucket, (unit, index of the tensor in its unit, the unit's
    tensor count, spec)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    group: list[tuple[U, int, int, TensorSpec]] = []
    size = 0
    for unit in units:
        specs = specs_of(unit)
        for index, spec in enumerate(specs):
            if group and size + spec.nbytes > bucket_bytes:
                yield group
                group, size = [], 0
            group.append((unit, index, len(specs), spec))
            size += spec.nbytes
    if group:
        yield group


def _fill(slot: torch.Tensor, tensor: torch.Tensor) -> None:
    """``tensor`` into its bucket slot, unless it was made there (a function, so that no local
    name keeps a view of the bucket alive once it is handed out)."""
    if tuple(tensor.shape) != tuple(slot.shape):
        raise RuntimeError(
            f"weight stream: a tensor of shape {tuple(tensor.shape)} was made for a bucket slot "
            f"planned as {tuple(slot.shape)}; the backend's planned shapes and its gathers disagree"
        )
    if tensor.data_ptr() != slot.data_ptr() or tensor.numel() == 0:
        slot.copy_(tensor)


def planned_buckets(
    units: Iterable[U],
    specs_of: Callable[[U], Sequence[TensorSpec]],
    make: Callable[[U, torch.Tensor | None], Sequence[torch.Tensor]],
    bucket_bytes: int,
    *,
    keep: bool,
    device: torch.device | str,
) -> WeightBuckets:
    """A backend's stream from its units, bucketed on their shapes (`specs_of`, no gather)
    before any tensor is made: each bucket is a `FlatBucket` on ``device``, filled unit by unit.

    ``make(unit, out)`` gathers one unit (collective: every rank calls it for every unit, in
    order) and returns its tensors, in `specs_of` order; ``out``, when not None, is where the
    unit's single tensor goes in the bucket, and ``make`` may write it there itself (then it
    returns ``[out]``) instead of returning a tensor to be copied in. Ranks that do not
    ``keep`` take part in every ``make`` (``out`` is None) and get no buckets. A unit cut by a
    bucket boundary is made once; its tensors wait for the next bucket."""
    made: Sequence[torch.Tensor] | None = None
    current: Any = None
    for group in _plan(units, specs_of, bucket_bytes):
        bucket = FlatBucket([spec for *_, spec in group], device) if keep else None
        for k, (unit, index, count, _) in enumerate(group):
            if made is None or current is not unit:
                whole = bucket is not None and count == 1
                made, current = make(unit, bucket.slots[k] if whole else None), unit
            if bucket is not None:
                _fill(bucket.slots[k], made[index])
            if index == count - 1:
                made, current = None, None  # the unit's gathered tensors are freed here
        if bucket is not None:
            tensors = bucket.tensors()
            del bucket  # the consumer's list holds the buffer now, nothing else
            yield tensors
            del tensors


def state_buckets(
    state: Mapping[str, torch.Tensor],
    bucket_bytes: int,
    *,
    dst: int | None,
    device: torch.device | str,
) -> WeightBuckets:
    """A state dict every rank already holds whole (a backend's computed weights, e.g. an
    adapter merged into its base) as a stream's buckets, on ``dst`` only."""
    if not receives(dst):
        return iter(())
    return planned_buckets(
        list(state.items()),
        lambda unit: [spec_of(*unit)],
        lambda unit, out: [unit[1]],
        bucket_bytes,
        keep=True,
        device=device,
    )


def gather_rows(out: torch.Tensor, shard: torch.Tensor, group: Any) -> torch.Tensor:
    """Fill ``out`` with every rank's equal ``shard`` of dim 0, in group-rank order (an
    all-gather; collective over ``group``). On the CPU it is one broadcast per rank straight into
    ``out``'s rows: gloo's all-gather stages the whole output in a buffer of its own first, which
    would double the host memory of the largest tensors."""
    if out.device.type != "cpu":
        dist.all_gather_into_tensor(out, shard.contiguous(), group=group)
        return out
    me = dist.get_rank(group)
    for r, rows in enumerate(out.chunk(dist.get_world_size(group))):
        if r == me:
            rows.copy_(shard.reshape(rows.shape))
        dist.broadcast(rows, src=dist.get_global_rank(group, r), group=group)
    return out


def as_buckets(state_dict: Mapping[str, torch.Tensor]) -> WeightBuckets:
    """A state dict already in memory (a test's, a single-process tool's) as one bucket."""
    yield list(state_dict.items())


def drain(buckets: Iterable[Bucket]) -> None:
    """Run a stream to its end without keeping anything: a rank that does not receive, or one
    whose consumer failed, must still take part in every gather the stream makes."""
    for _ in buckets:
        pass


def first_non_finite_local(tensors: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first floating-point tensor holding a NaN or an infinity, or None."""
    for name, tensor in tensors:
        if tensor.is_floating_point() and tensor.numel() and not _all_finite(tensor):
            return name
    return None


_CHECK_ELEMENTS = 1 << 22  # isfinite's bool mask of a chunk: 4 MiB, not the whole shard's


def _all_finite(tensor: torch.Tensor) -> bool:
    if not tensor.is_contiguous() or tensor.numel() <= _CHECK_ELEMENTS:
        return bool(torch.isfinite(tensor).all())
    return all(bool(torch.isfinite(c).all()) for c in tensor.view(-1).split(_CHECK_ELEMENTS))


def agree_non_finite(local: str | None, device: torch.device, group: Any = None) -> str | None:
    """Every rank's answer to "is any weight non-finite?" from each rank's `local` finding: one
    all-reduce of a flag; only when it is set are the names gathered (the lowest rank's first)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return local
    flag = torch.tensor([0 if local is None else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not int(flag.item()):
        return None
    names: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, local, group=group)
    return next(n for n in names if n is not None)


def checked_stream(
    find_non_finite: Callable[[], str | None], make: Callable[[], WeightBuckets]
) -> WeightBuckets:
    """``make()``'s stream, after the (collective) check found every weight finite; raises
    `NonFiniteWeightsError` on every rank, eagerly, before any bucket exists."""
    bad = find_non_finite()
    if bad is not None:
        raise NonFiniteWeightsError(bad)
    return make()


def receives(dst: int | None) -> bool:
    """Whether this process gets the buckets of a stream to ``dst``."""
    if dst is None or not (dist.is_available() and dist.is_initialized()):
        return True
    return dist.get_rank() == dst
