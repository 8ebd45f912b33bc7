"""``python unirl/rollouts/vllm/reaper.py PARENT PID...``: kill a vLLM engine's processes when
the process that started it dies without closing it (SIGKILL, out of memory).

vLLM's engine core does not watch its client: with the trainer or ``unirl serve`` killed it goes
on running, re-parented, polling for requests that never come (seen with vLLM 0.32's CPU build:
its core and worker left at ~20% CPU each). `VllmEngine.close` covers every ending the process
lives through; this small process (started by `watch`, one per engine) covers the one it does
not: every `POLL_S` it checks that its parent ``PARENT`` is still its parent, and when it is not
it kills ``PID...`` (the engine's processes) and exits. It also exits once they are all gone (the
engine closed or restarted); `VllmEngine.close` ends it as well.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterable

POLL_S = 0.5


def watch(pids: Iterable[int]) -> subprocess.Popen:
    """Start the reaper of the engine processes ``pids`` (children of this process)."""
    # run as a file: it needs nothing of unirl, so it starts wherever unirl was imported from
    args = [sys.executable, __file__, str(os.getpid()), *map(str, pids)]
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, close_fds=True)


def _kill(pids: list[int]) -> None:
    import psutil

    for pid in pids:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            continue


def main(argv: list[str]) -> int:
    import psutil

    parent, pids = int(argv[0]), [int(p) for p in argv[1:]]
    while True:
        if os.getppid() != parent:  # re-parented: the engine's owner died
            _kill(pids)
            return 0
        if not any(psutil.pid_exists(p) for p in pids):
            return 0
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
