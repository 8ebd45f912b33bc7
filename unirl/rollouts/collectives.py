"""The process group a rollout source's collectives run on, per thread.

In the synchronous loop a source's collectives (the vLLM source broadcasting each rollout from
global rank 0) run on the default group, in step with the trainer's. With
``train.max_staleness > 0`` the source is called from the rollout worker thread while the
trainer's collectives (gradient all-reduces, the weight stream's gathers) run on the default group
in the main thread: two threads issuing collectives on one group interleave them differently on
each rank (a hang, or one rank's data in another's collective). So the worker gets a group of its
own over the same ranks (`RolloutsAhead` makes it, on every rank, in the same order) and binds it
to its thread; a source runs every collective it makes on `rollout_group()`, which is that group
in the worker and None (the default group) anywhere else.

    dist.broadcast_object_list(box, src=0, group=rollout_group())
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch.distributed as dist

_local = threading.local()


def rollout_group() -> dist.ProcessGroup | None:
    """The group for the calling thread's rollout collectives; None is the default group."""
    group: dist.ProcessGroup | None = getattr(_local, "group", None)
    return group


def bind_rollout_group(group: dist.ProcessGroup | None) -> None:
    """Make ``group`` the calling thread's rollout group (the worker's initializer)."""
    _local.group = group


def new_rollout_group(timeout_s: float | None = None) -> dist.ProcessGroup | None:
    """A group over every rank for the rollout worker, or None on one process. Collective:
    every rank calls it at the same point. Gloo: what travels on it is Python objects (finished
    rollouts, an error's text), which need no device memory and no stream ordering beside the
    trainer's kernels."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    if timeout_s is None:
        return dist.new_group(backend="gloo")
    # a source whose waits are bounded by their own poll (the vLLM exchange) needs the group's
    # timeout above that bound, or gloo fails first
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
