"""A hung rank ends the job on every rank within ``parallel.timeout_s``.

When one rank stops answering (stopped, deadlocked, stuck in I/O), every other rank blocks in its
next collective. The process group's timeout (``parallel.timeout_s``, set by
`unirl.backends.process_group` for the default group and every group the engines create after
it) turns that wait into an error on the ranks that wait; this module turns the error into a
clean end of the job:

- `is_collective_timeout` recognises it (gloo raises a RuntimeError "Timed out waiting ...",
  NCCL a DistBackendError; NCCL's own watchdog aborts the process as well);
- `stop_unresponsive_peers` kills the other ranks of this host (their pids are exchanged once,
  when the process group is created): a rank that stopped answering cannot exit by itself (a
  SIGSTOPped process does not even see the launcher's SIGTERM, which torchrun follows with SIGKILL
  only 30 s later), and a rank killed this way is the launcher's sign to end the job; ranks on
  other hosts time out on their own;
- `exit_now` leaves without destroying the process group: destroying a gloo group with a
  collective still pending aborts the process ("terminate called without an active exception").
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys

import torch.distributed as dist

from unirl.core.errors import UnirlError

logger = logging.getLogger(__name__)

_peers: list[tuple[str, int]] = []  # (hostname, pid) of every rank, by rank


def record_peers() -> None:
    """Collective, once after the default process group is created: learn every rank's pid."""
    global _peers
    mine = (socket.gethostname(), os.getpid())
    table: list[tuple[str, int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(table, mine)
    _peers = [p for p in table if p is not None]


def is_collective_timeout(exc: BaseException) -> bool:
    """A process group's timeout, as gloo or NCCL raise it; never one of unirl's own errors (a
    reward that timed out names its sample and is not a hung rank)."""
    if isinstance(exc, UnirlError):
        return False
    text = str(exc)
    if isinstance(exc, getattr(dist, "DistBackendError", ())) and "imeout" in text:
        return True
    return isinstance(exc, RuntimeError) and ("Timed out waiting" in text or "timed out" in text)


# What gloo and NCCL say when the rank at the other end of a collective is gone (killed, crashed):
# the connection closes before any timeout.
_PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote process exited",
    "Broken pipe",
)


def is_peer_gone(exc: BaseException) -> bool:
    """A collective that failed because another rank's process is gone; never one of unirl's
    own errors."""
    if isinstance(exc, UnirlError):
        return False
    dist_error = getattr(dist, "DistError", ())
    text = str(exc)
    return isinstance(exc, (RuntimeError, *((dist_error,) if dist_error else ()))) and any(
        words in text for words in _PEER_GONE
    )


def stop_unresponsive_peers() -> list[int]:
    """Kill the other ranks on this host (SIGCONT first, so that a stopped one dies at once).
    Returns the pids signalled."""
    me, host = os.getpid(), socket.gethostname()
    killed = []
    for peer_host, pid in _peers:
        if peer_host != host or pid == me:
            continue
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break
            except PermissionError:
                logger.warning("cannot signal rank process %d (not ours)", pid)
                break
        else:
            killed.append(pid)
    return killed


def exit_now(status: int) -> None:
    """Flush what was logged and leave without tearing down the process group."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    logging.shutdown()
    os._exit(status)
