"""CPU thread defaults, applied by the `unirl` command before torch is imported.

torch's intra-op pool is as wide as the machine and OpenMP's idle threads spin before they
sleep. When another process wants a core (a laptop, a shared CI runner, two unirl runs side by
side), a pool that needs every core waits at each barrier for a thread the OS has descheduled.
Measured on the project's 2-core machine, otherwise idle, the tiny example
(``benchmarks/cpu_threads.py --steps 20``, s/step alone / beside one busy process):

- torch's default (2 threads, spinning): 0.080-0.087 / 0.47-0.68 (5.8-7.8x slower);
- ``OMP_WAIT_POLICY=PASSIVE``: 0.31-0.33 / 0.11 (sleeping threads wake too slowly for the tiny
  model's many small ops: 4x slower alone);
- one thread per core but one (here 1): 0.089 / 0.094 (1.06x).

So the default leaves one core to the rest of the machine: ``OMP_NUM_THREADS`` is
``(cores - 1) // local ranks``, at least 1, and the wait policy is left alone. Anything the user
set wins (torchrun sets ``OMP_NUM_THREADS=1`` for several ranks itself); ``UNIRL_CPU_THREADS=off``
leaves the environment alone.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

logger = logging.getLogger(__name__)

OFF_ENV = "UNIRL_CPU_THREADS"


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def apply_cpu_thread_defaults(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set the defaults in `environ` (read by OpenMP when torch loads); returns what was set."""
    if environ.get(OFF_ENV, "").strip().lower() in ("0", "off", "false", "no"):
        return {}
    chosen: dict[str, str] = {}
    local_ranks = int(environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if "OMP_NUM_THREADS" not in environ:
        chosen["OMP_NUM_THREADS"] = str(max((_cores() - 1) // local_ranks, 1))
    environ.update(chosen)
    return chosen
