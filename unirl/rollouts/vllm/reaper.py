"""``python unirl/rollouts/vllm/reaper.py PARENT PID:START...``: kill a vLLM engine's processes when
the process that started it dies without closing it (SIGKILL, out of memory).

vLLM's engine core does not watch its client: with the trainer or ``unirl serve`` killed it goes
on running, re-parented, polling for requests that never come (seen with vLLM 0.32's CPU build:
its core and worker left at ~20% CPU each). `VllmEngine.close` covers every ending the process
lives through; this small process (started by `watch`, one per engine) covers the one it does
not: every `POLL_S` it checks that its parent ``PARENT`` is still its parent, and when it is not
it kills ``PID...`` (the engine's processes) and exits. It also exits once they are all gone (the
engine closed or restarted); `VllmEngine.close` ends it as well.

Each PID comes with its process's start time (``START``, psutil's ``create_time``): a process of
the engine that exited gives its PID back to the system, which may give it to any later process
(another job of this user among them), so a PID whose process started at another time is no
longer the engine's and is neither killed nor waited for.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import psutil

POLL_S = 0.5
# Start times of one process read by two processes may differ by psutil's rounding of the boot
# time (whole seconds); a PID given to a new process was first held by one that exited before.
_SAME_START_S = 1.0


def identities(pids: Iterable[int]) -> list[str]:
    """``PID:START`` of each live process in ``pids`` (the reaper's arguments)."""
    import psutil

    out = []
    for pid in pids:
        try:
            out.append(f"{pid}:{psutil.Process(pid).create_time()!r}")
        except psutil.NoSuchProcess:
            continue  # gone already: nothing to kill, and its PID may be reused
    return out


def watch(pids: Iterable[int]) -> subprocess.Popen:
    """Start the reaper of the engine processes ``pids`` (children of this process)."""
    # run as a file: it needs nothing of unirl, so it starts wherever unirl was imported from
    args = [sys.executable, __file__, str(os.getpid()), *identities(pids)]
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, close_fds=True)


def _alive(identity: str) -> psutil.Process | None:
    """The process ``PID:START`` names, while it runs; None once it is gone (its PID free, or
    held by a process started at another time)."""
    import psutil

    pid, start = identity.split(":")
    try:
        proc = psutil.Process(int(pid))
        if abs(proc.create_time() - float(start)) > _SAME_START_S:
            return None  # the PID was given to another process
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc
    except psutil.Error:
        return None


def main(argv: list[str]) -> int:
    import psutil

    parent, engine = int(argv[0]), argv[1:]
    while True:
        procs = [p for p in map(_alive, engine) if p is not None]
        if os.getppid() != parent:  # re-parented: the engine's owner died
            for proc in procs:
                try:
                    proc.kill()
                except psutil.Error:
                    continue
            return 0
        if not procs:
            return 0
        time.sleep(POLL_S)


if __name__ == "__main__":
    # Ctrl-C reaches the terminal's whole process group: the owner decides whether the run ends,
    # and the reaper keeps watching in case it is killed on the way out
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(main(sys.argv[1:]))
