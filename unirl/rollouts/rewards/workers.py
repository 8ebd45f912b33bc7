"""A reward function run in worker processes (``rollout.reward_workers: N``), one sample per call,
each with its own time limit (``rollout.reward_timeout_s``).

For a slow or unsafe reward (a sandbox that runs the policy's code, a remote judge): the training
process never runs it, so a reward that hangs, leaks memory or kills its process costs that
sample, not the job. Workers are ``multiprocessing`` processes started with ``spawn`` (no copy of
the trainer's threads, CUDA context or process group), kept for the run and fed one sample at a
time over a pipe. They are not daemons, so a reward may start processes of its own (a
``multiprocessing`` pool, a sandbox); each worker leads a process group of its own, and stopping
a worker kills its group, so what a reward started never outlives it; a sample that overruns its time is answered by killing its worker (and starting
a fresh one), a worker that dies is replaced the same way. Each sample's outcome is its reward or a
`SampleFailure` saying what went wrong (``timeout``, ``crash``: the process died, ``error``: the
function raised); `unirl.rollouts.rewards.registry.NamedReward` turns failures into the configured reward
or a named error (``rollout.reward_on_error``).

The function keeps the batched signature (`unirl.rollouts.rewards.registry`): each call gets lists of one
sample. It reaches the workers by pickling, i.e. by its module and name: a module-level function
(a lambda or a closure cannot be sent; that is a `ConfigError` when the pool starts).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import pickle
import signal
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any, Literal

import attrs

from unirl.core.errors import ConfigError, RunError

logger = logging.getLogger(__name__)

# How long a fresh worker may take to start and import the function.
STARTUP_TIMEOUT_S = 120.0

# One sample's inputs: (prompt, response, metadata, prompt_tokens, response_tokens).
SampleInputs = tuple[str, str, Mapping[str, Any], Sequence[int], Sequence[int]]


class RewardError(RunError):
    """A sample's reward could not be computed in its worker (``rollout.reward_on_error:
    raise``)."""


class RewardTimeoutError(RewardError):
    """A sample's reward took longer than ``rollout.reward_timeout_s``."""


class RewardCrashError(RewardError):
    """The worker process scoring a sample died (a segfault, the OOM killer, ``os._exit``)."""


@attrs.frozen
class SampleFailure:
    """Why one sample has no reward: it ran out of time, its worker died, or the function
    raised (``message`` says how)."""

    kind: Literal["timeout", "crash", "error"]
    message: str


def _serve(conn: Connection, payload: bytes) -> None:
    """A worker's loop: score the samples it is sent until it is sent None."""
    os.setpgid(0, 0)  # its own process group: `_Worker.stop` ends what the reward started too
    fn, options = pickle.loads(payload)
    conn.send(("ready", None))  # a sample's time starts once the function is imported
    while True:
        job = conn.recv()
        if job is None:
            return
        prompt, response, metadata, prompt_tokens, response_tokens = job
        try:
            values = list(
                fn(
                    [prompt],
                    [response],
                    [dict(metadata)],
                    prompt_tokens=[list(prompt_tokens)],
                    response_tokens=[list(response_tokens)],
                    **options,
                )
            )
        except Exception as exc:  # user code: reported for its sample, the worker lives on
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        else:
            conn.send(("ok", values))


class _Worker:
    def __init__(self, ctx: Any, payload: bytes) -> None:
        self.conn, child = ctx.Pipe()
        # not a daemon: a daemonic process may not start children, and rewards may
        self.process = ctx.Process(target=_serve, args=(child, payload), daemon=False)
        self.process.start()
        child.close()
        self.job: int | None = None  # the sample it is scoring
        self.deadline = float("inf")
        self.ready = False

    def wait_ready(self, spec: str) -> None:
        """Block until the worker has imported the function (a spawned process starts an
        interpreter and imports the function's module)."""
        if self.ready:
            return
        try:
            if not self.conn.poll(STARTUP_TIMEOUT_S):
                raise EOFError
            self.conn.recv()
        except (EOFError, OSError):
            self.stop(kill=True)
            raise RunError(
                f"a reward worker for rollout.reward={spec!r} did not start within "
                f"{STARTUP_TIMEOUT_S:.0f} s (exit code {self.process.exitcode}): its module "
                "must import in a fresh interpreter (check PYTHONPATH; logging.level: DEBUG and "
                "the process's stderr say why)"
            ) from None
        self.ready = True

    def stop(self, *, kill: bool) -> None:
        if kill:
            self.process.kill()
        else:
            with contextlib.suppress(OSError):  # a dead worker's pipe is closed
                self.conn.send(None)
        self.process.join(timeout=None if kill else 5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._kill_group()
        self.conn.close()

    def _kill_group(self) -> None:
        """Whatever the reward started and left running (the worker's process group)."""
        pid = self.process.pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


def _stop_all(workers: list[_Worker]) -> None:
    for w in workers:
        w.stop(kill=True)
    workers.clear()


class RewardWorkers:
    """``count`` worker processes running ``fn(**options)`` on one sample per call, each call
    limited to ``timeout_s`` seconds (None: no limit). Started at the first `score`; `close`
    (or the end of the process) stops them."""

    def __init__(
        self,
        fn: Callable[..., Sequence[float]],
        options: Mapping[str, Any],
        *,
        count: int,
        timeout_s: float | None,
        spec: str,
    ) -> None:
        try:
            self._payload = pickle.dumps((fn, dict(options)))
        except Exception as exc:
            raise ConfigError(
                f"rollout.reward={spec!r} with rollout.reward_workers={count}: the function and "
                f"rollout.reward_options must pickle to reach the worker processes ({exc}); make "
                "it a module-level function (not a lambda or a closure), or set "
                "rollout.reward_workers: 0"
            ) from None
        self.count, self.timeout_s, self.spec = count, timeout_s, spec
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)

    def _start(self) -> _Worker:
        return _Worker(self._ctx, self._payload)

    def score(
        self, samples: Sequence[SampleInputs], *, stop_on_failure: bool = False
    ) -> list[list[float] | SampleFailure | None]:
        """Each sample's values (what the function returned for it: one reward when it keeps
        its contract) or its `SampleFailure`, in order. ``stop_on_failure``: after the first
        failure no sample is started and the busy workers are replaced; the samples not scored
        are None (a run that stops at a failure does not wait out every later sample's
        timeout)."""
        while len(self._workers) < self.count:
            self._workers.append(self._start())
        outcomes: list[list[float] | SampleFailure | None] = [None] * len(samples)
        pending = deque(range(len(samples)))
        limit = self.timeout_s
        while pending or any(w.job is not None for w in self._workers):
            if stop_on_failure and any(isinstance(o, SampleFailure) for o in outcomes):
                pending.clear()
                for i, w in enumerate(self._workers):
                    if w.job is not None:
                        self._replace(i, kill=True)
                break
            for w in self._workers:
                if w.job is None and pending:
                    w.wait_ready(self.spec)
                    w.job = pending.popleft()
                    w.conn.send(tuple(samples[w.job]))
                    w.deadline = time.monotonic() + limit if limit is not None else float("inf")
            busy = [w for w in self._workers if w.job is not None]
            nearest = min(w.deadline for w in busy)
            wait_s = None if nearest == float("inf") else max(0.0, nearest - time.monotonic())
            ready = set(wait([w.conn for w in busy], timeout=wait_s))
            for i, w in enumerate(self._workers):
                if w.job is None:
                    continue
                index = w.job
                if w.conn in ready:
                    try:
                        status, value = w.conn.recv()
                    except (EOFError, OSError):  # the process died mid-sample
                        w.process.join(timeout=5)
                        outcomes[index] = SampleFailure(
                            "crash",
                            f"the worker process died (exit code {w.process.exitcode}) while "
                            "scoring it",
                        )
                        self._replace(i, kill=True)
                        continue
                    w.job = None
                    outcomes[index] = (
                        [v for v in value] if status == "ok" else SampleFailure("error", value)
                    )
                elif time.monotonic() >= w.deadline:
                    outcomes[index] = SampleFailure(
                        "timeout", f"it took longer than rollout.reward_timeout_s={limit}"
                    )
                    self._replace(i, kill=True)
        return outcomes

    def _replace(self, i: int, *, kill: bool) -> None:
        old = self._workers[i]
        old.stop(kill=kill)
        logger.debug("reward worker %d (pid %s) replaced", i, old.process.pid)
        self._workers[i] = self._start()

    def close(self) -> None:
        """Stop every worker (politely; one that does not stop at once is killed)."""
        workers = list(self._workers)
        self._workers.clear()
        for w in workers:
            w.stop(kill=w.job is not None)
        self._finalizer.detach()
