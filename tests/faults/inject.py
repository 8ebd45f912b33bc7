"""``python -m tests.faults.inject FAULT -- <unirl args>``: run the unirl CLI in this process with
one fault installed first (a patch of the library, made here so that the library itself carries no
fault hooks). FAULT is ``name`` or ``name:argument``; see `FAULTS`."""

from __future__ import annotations

import errno
import os
import signal
import sys
from collections.abc import Callable


def disk_full_at_checkpoint(n: str) -> None:
    """The ``n``-th checkpoint publish (1-based) finds the disk full while it writes its marker."""
    from unirl.core.run import checkpointing

    original = checkpointing.publish
    calls = {"n": 0}

    def publish(partial, path, meta, *, client_state):
        calls["n"] += 1
        if calls["n"] == int(n):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(partial / "complete"))
        return original(partial, path, meta, client_state=client_state)

    checkpointing.publish = publish


def kill_rank_in_worker(spec: str) -> None:
    """``rank,rollout``: global rank ``rank`` kills itself (SIGKILL) when its async worker starts
    generating rollout ``rollout``."""
    rank, rollout = (int(x) for x in spec.split(","))
    if int(os.environ.get("RANK", "0")) != rank:
        return
    from unirl.rollouts import async_source

    original = async_source.RolloutsAhead._generate

    def generate(self, rl_step, weights, version):
        if rl_step == rollout:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, rl_step, weights, version)

    async_source.RolloutsAhead._generate = generate


FAULTS: dict[str, Callable[[str], None]] = {
    "disk_full_at_checkpoint": disk_full_at_checkpoint,
    "kill_rank_in_worker": kill_rank_in_worker,
}


def main() -> int:
    fault, sep, *args = sys.argv[1:]
    assert sep == "--", "usage: python -m tests.faults.inject FAULT -- <unirl args>"
    name, _, argument = fault.partition(":")
    FAULTS[name](argument)
    from unirl.cli import main as unirl_main

    return unirl_main(args)


if __name__ == "__main__":
    sys.exit(main())
