"""The policy's weights on their way to a rollout source: Hugging Face-named tensors in buckets,
made by the ranks that own them, so that no rank ever holds the whole model for a sync.

    buckets = backend.stream_weights(bucket_bytes, dst=0)   # collective; refuses non-finite weights
    for bucket in buckets:                                  # every rank iterates to the end
        for name, tensor in bucket:                         # CPU tensors, on the receiving rank(s)
            ...

A bucket holds at most ``bucket_bytes`` unless a single tensor is larger (it then travels
alone). ``dst``: the global rank that receives (the one running the engine), or None for every
rank (a sampler on every rank). Ranks that do not receive iterate too (they take part in the
gathers) and get no buckets. Before the first bucket is made, every rank scans its own shards
for a NaN or an infinity and one all-reduce of a flag decides: a non-finite model never reaches
an engine (`NonFiniteWeightsError`, naming the first such parameter).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from unirl.core.errors import RunError

# One bucket: (Hugging Face name, tensor) pairs.
Bucket = list[tuple[str, torch.Tensor]]
WeightBuckets = Iterator[Bucket]

MIB = 1 << 20


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
        if tensor.is_floating_point() and tensor.numel() and not bool(torch.isfinite(tensor).all()):
            return name
    return None


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
