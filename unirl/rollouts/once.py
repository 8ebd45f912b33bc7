"""Work done once per job, on global rank 0, with its result (or its failure) on every rank.

Every rank holds the same rollout, so a reward function, a post-processing hook or an
evaluation gives every rank the same answer; running it on each would call a remote reward
model or a sandbox once per rank. `on_rank0` runs it on global rank 0 only and broadcasts what
it returned over the default process group (``broadcast_object_list``, one object per call).
A failure on rank 0 is broadcast too, so every rank raises it instead of waiting in a
collective for a result that never comes. One process (or no process group): a plain call.

The broadcast is a collective: every rank must call `on_rank0` at the same point of the job. It
runs on the default group, or in the rollout worker (``train.max_staleness > 0``) on that
thread's own group (`unirl.rollouts.collectives.rollout_group`), so it never interleaves with
the trainer's collectives.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from unirl.core.errors import RunError
from unirl.rollouts.collectives import rollout_group

T = TypeVar("T")


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _portable(exc: BaseException, what: str) -> BaseException:
    """``exc`` if it survives pickling (the project's own errors do), else a `RunError` with its
    type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RunError(f"{what} failed on rank 0: {type(exc).__name__}: {exc}")
    return exc


def on_rank0(fn: Callable[[], T], what: str) -> T:
    """``fn()`` run on global rank 0, its result on every rank; ``what`` names the work in the
    error other ranks raise when it cannot be shipped as it was."""
    rank, world = _world()
    if world == 1:
        return fn()
    box: list[object] = [None]
    failure: BaseException | None = None
    if rank == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as exc:
            failure = exc
            box[0] = ("error", _portable(exc, what))
    dist.broadcast_object_list(box, src=0, group=rollout_group())
    status, value = box[0]  # type: ignore[misc]
    if failure is not None:
        raise failure  # rank 0: its own exception, traceback intact
    if status == "error":
        assert isinstance(value, BaseException)
        raise value
    return value  # type: ignore[no-any-return]
