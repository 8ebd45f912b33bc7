"""Work done once per job, on global rank 0, with its result (or its failure) on every rank.

Every rank holds the same rollout, so a reward function, a post-processing hook, a multi-turn
episode or an evaluation gives every rank the same answer; running it on each would call a remote
reward model, a tool or a sandbox once per rank. `on_rank0` runs it on global rank 0 only and
broadcasts what it returned. A failure on rank 0 is broadcast too, so every rank raises it instead
of waiting for a result that never comes. One process (or no process group): a plain call.

The other ranks wait on the bounded exchange the vLLM rollouts use (`RolloutExchange`: a gloo
group of its own, polled), never in a training collective, each wait bounded by the work's own
timeout, never by ``parallel.timeout_s``: an evaluation by ``eval.timeout_s``, the hook by
``algorithm.rollout_postprocess_timeout_s``, rewards in worker processes by what bounds them on
rank 0 (``rollout.reward_timeout_s`` per sample, `RewardRun.wait_bound`). Past it the waiting
rank stops with an error naming what it waited for and the setting. Work with no bound on rank 0
either (``timeout_s`` None: a reward in the training process; episodes, whose generation has no
timeout on the sampler though each environment call has ``rollout.env_step_timeout_s``) is
waited for as long as rank 0 works on it.

The broadcast is a collective: every rank must call `on_rank0` at the same point of the job. In
the rollout worker (``train.max_staleness > 0``) it runs on that thread's own group
(`unirl.rollouts.collectives.rollout_group`), elsewhere on one gloo group of its own made at the
first call (`waits_group`).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from unirl.core.errors import RunError
from unirl.rollouts.collectives import rollout_group
from unirl.rollouts.serving.exchange import UNBOUNDED_S, RolloutExchange

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


_waits: tuple[Any, Any] | None = None  # (the default group, its waits group)


def waits_group() -> dist.ProcessGroup:
    """The gloo group `on_rank0`'s waits run on outside the rollout worker, made at its first
    call under the current default group (collective: every rank at the same point). Its gloo
    timeout is long: each wait's deadline is the exchange's poll."""
    global _waits
    world_group = dist.group.WORLD
    if _waits is None or _waits[0] is not world_group:  # a re-initialised job gets its own
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=UNBOUNDED_S))
        _waits = (world_group, group)
    return _waits[1]  # type: ignore[no-any-return]


def on_rank0(
    fn: Callable[[], T],
    what: str,
    *,
    timeout_s: float | None = None,
    key: str = "",
    advice: str = "",
    limit: str | None = None,
) -> T:
    """``fn()`` run on global rank 0, its result on every rank; ``what`` names the work in the
    errors of the other ranks. They wait at most ``timeout_s`` (the setting ``key``, or as
    ``limit`` names a bound derived from several; None: as long as rank 0 works), then raise a
    `RunError` naming it and ending with ``advice``."""
    rank, world = _world()
    if world == 1:
        return fn()
    group = None if rollout_group() is not None else waits_group()
    exchange = RolloutExchange(timeout_s, key=key, advice=advice, group=group, limit=limit)
    box: object = None
    failure: BaseException | None = None
    if rank == 0:
        try:
            box = ("ok", fn())
        except Exception as exc:
            failure = exc
            box = ("error", _portable(exc, what))
    status, value = exchange.broadcast(box, src=0, what=what)  # type: ignore[misc]
    if failure is not None:
        raise failure  # rank 0: its own exception, traceback intact
    if status == "error":
        assert isinstance(value, BaseException)
        raise value
    return value  # type: ignore[no-any-return]
