"""The server under torchrun: rank 0 serves HTTP and runs the queue; every other rank runs the
same backend calls, in the same order, so that tensor- and pipeline-parallel ranks take part.

    torchrun --nproc_per_node 2 -m unirl.cli serve serve.yaml   # serve.train: megatron, tp 2

Rank 0's worker hands each unit of work that touches a backend (create, forward /
forward_backward, optim_step, save, load; not sampling, which runs on rank 0's sampler alone)
to the other ranks as a value before running it, and afterwards the ranks gather their outcomes:
the reporting rank of a pipeline (its last stage) is the one with the log-probs and losses, and
an error on any rank is the unit's error on every rank, so all ranks agree on which clients
stopped. The values travel on a gloo group of the relay's own (`RolloutExchange`), never inside
a training collective: a rank waiting for the next request waits as long as the server is idle;
rank 0 waits for the other ranks to take a unit at most the run's collective timeout
(``parallel.timeout_s``), then fails the unit with a message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from unirl.rollouts.serving.exchange import RolloutExchange, world
from unirl.serve.futures import Outcome

_ADVICE = "the serving rank waits for requests as long as the server runs"


class JobRelay:
    """Rank 0's units of work to the other ranks, and every rank's outcomes back (collective:
    every rank makes it at the same point, after the process group and before any backend)."""

    def __init__(self) -> None:
        self.rank, self.world = world()
        self._exchange = RolloutExchange(None, key="serve (no deadline)", advice=_ADVICE)

    @property
    def serving(self) -> bool:
        """The rank that runs the HTTP server and the futures (global rank 0)."""
        return self.rank == 0

    def send(self, unit: Sequence[Any] | None) -> None:
        """Rank 0: the next unit (None: the server stops)."""
        self._exchange.broadcast(list(unit) if unit is not None else None, src=0, what="a job")

    def receive(self) -> list[Any] | None:
        """The other ranks: rank 0's next unit, or None when the server stops."""
        return self._exchange.broadcast(None, src=0, what="the server's next job")  # type: ignore[no-any-return]

    def agree(self, mine: list[Outcome] | None) -> list[Outcome]:
        """The unit's outcomes every rank takes: the first rank's error if any rank failed,
        else the outcomes of the first rank that has them (None: this rank has no results, as
        a pipeline stage before the last)."""
        every = self._exchange.all_gather(mine, what="the outcomes of a job")
        for outcomes in every:
            if outcomes is not None and any(o.error is not None for o in outcomes):
                return list(outcomes)
        for outcomes in every:
            if outcomes is not None:
                return list(outcomes)
        raise AssertionError("no rank has the outcomes of the job")

    def barrier(self) -> None:
        """Every rank reached this point (a save's folder is made / complete)."""
        self._exchange.all_gather(None, what="a save's barrier")
