"""Python objects between the ranks of a vLLM run while the engines generate, on a gloo group of
its own and with a bounded poll, so that a rank waiting for a long generation waits for
``rollout.vllm.generation_timeout_s`` and then fails with a message, instead of inside a
training collective (whose timeout, 30 minutes by default, kills the job with a stack trace).

    exchange = RolloutExchange(timeout_s=3600)          # collective: every rank, same order
    shares = exchange.all_gather(mine, what="the samples of rollout 3")
    batch = exchange.broadcast(batch_or_none, src=0, what="rollout 3")

Objects travel pickled as byte tensors: first their sizes (the wait that lasts as long as the
generation), then the bytes. With one process nothing is sent.
"""

from __future__ import annotations

import logging
import pickle
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from unirl.core.errors import CollectiveTimeoutError, WaitTimeoutError
from unirl.rollouts.collectives import rollout_group

logger = logging.getLogger(__name__)

_POLL_S = 0.05
# gloo's own timeout for a group whose waits have no deadline: the work they wait for is bounded
# where it runs (a reward's or an environment call's timeout), so gloo must not end it first
UNBOUNDED_S = 7 * 24 * 3600.0
_GENERATION_ADVICE = (
    "raise it, or generate less per rollout (rollout.max_new_tokens, batch.prompts_per_rollout) or with more "
    "engines (rollout.vllm.engines)"
)


def _peer_timeout_s() -> float:
    """The run's collective timeout (``parallel.timeout_s``, which `unirl.backends.process_group`
    makes torch's default for new groups)."""
    return float(dist.distributed_c10d.default_pg_timeout.total_seconds())


def world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class RolloutExchange:
    """See the module docstring."""

    def __init__(
        self,
        timeout_s: float | None,
        *,
        key: str = "rollout.vllm.generation_timeout_s",
        advice: str = _GENERATION_ADVICE,
        group: dist.ProcessGroup | None = None,
        limit: str | None = None,
    ) -> None:
        """``timeout_s`` (None: no deadline of its own) is the setting ``key``; ``advice`` ends
        the error of a wait past it. ``group``: a gloo group made by the caller (`waits_group`)
        instead of a new one. ``limit``: how that error names a deadline derived from several
        settings (default ``key=timeout_s s``)."""
        self.timeout_s, self.key, self.advice = timeout_s, key, advice
        self.limit = limit or ("" if timeout_s is None else f"{key}={timeout_s:g} s")
        self.rank, self.world = world()
        # In the rollout worker (train.max_staleness > 0) its own group, made by every rank at
        # the same point (unirl/rollouts/collectives.py): a new_group here would be a collective
        # on the default group from the worker thread, racing the trainer's. Otherwise a group of
        # the exchange's own; gloo's timeout stays above the poll's, so the poll is what reports.
        bound = rollout_group()
        if bound is not None or self.world == 1:
            self.group = bound
        elif group is not None:
            self.group = group
        else:
            wait_s = UNBOUNDED_S if timeout_s is None else timeout_s + 60
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=wait_s))

    def _deadline(self) -> float:
        return float("inf") if self.timeout_s is None else time.monotonic() + self.timeout_s

    def _wait(self, work: Any, deadline: float, what: str, *, own: bool = False) -> None:
        while not work.is_completed():
            if time.monotonic() > deadline and own:
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: another rank did not take {what} within "
                    f"parallel.timeout_s={_peer_timeout_s():g} s (hung, stopped or dead)"
                )
            if time.monotonic() > deadline:
                raise WaitTimeoutError(
                    f"rank {self.rank} waited more than {self.limit} for {what}; {self.advice}"
                )
            time.sleep(_POLL_S)
        work.wait()

    def all_gather(self, obj: Any, *, what: str) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if self.group is None:
            return [obj]
        deadline = self._deadline()
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        self._wait(dist.all_gather(sizes, size, group=self.group, async_op=True), deadline, what)
        longest = max(int(s.item()) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: data.numel()] = data
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world)]
        self._wait(dist.all_gather(out, padded, group=self.group, async_op=True), deadline, what)
        return [pickle.loads(o[: int(s.item())].numpy().tobytes()) for o, s in zip(out, sizes)]

    def broadcast(self, obj: Any, *, src: int, what: str) -> Any:
        """``src``'s ``obj`` on every rank. The ranks that receive wait up to the exchange's
        deadline for ``src`` (its work may be long); ``src`` itself only waits for ranks that are
        already waiting, so it gives up after the run's collective timeout (``parallel.timeout_s``:
        a rank that stopped answering), with `CollectiveTimeoutError`."""
        if self.group is None:
            return obj
        own = self.rank == src
        deadline = self._deadline()
        if own:
            deadline = min(deadline, time.monotonic() + _peer_timeout_s())
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if own else None
        size = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64)
        sent = dist.broadcast(size, src=src, group=self.group, async_op=True)
        self._wait(sent, deadline, what, own=own)
        buf = data if data is not None else torch.empty(int(size.item()), dtype=torch.uint8)
        sent = dist.broadcast(buf, src=src, group=self.group, async_op=True)
        self._wait(sent, deadline, what, own=own)
        return obj if own else pickle.loads(buf.numpy().tobytes())
