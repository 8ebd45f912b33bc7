"""CPU thread defaults, applied by the `unirl` command before torch is imported.

OpenMP's default wait policy makes every idle thread of torch's intra-op pool spin for a while
before sleeping. On a machine where another process wants the same cores (a laptop, a shared
CI runner, two unirl runs side by side) the spinning threads take the cores from the threads
doing work. On the project's 2-core machine the tiny example took 0.11 s/step alone, 0.40 s
beside one busy process and 0.17 s there with ``OMP_WAIT_POLICY=PASSIVE`` (idle threads sleep at
once; measured when the problem was reported); with the machine shared by other test jobs (load average 6-13), torch's default took
3.7-20 s/step and the passive policy 0.10-0.45 s (``benchmarks/cpu_threads.py``, settings run
back to back). With several ranks on one host each rank gets its share of the cores instead of
one pool per rank as wide as the machine.

Anything the user set wins; ``UNIRL_CPU_THREADS=off`` leaves the environment alone.
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
    if "OMP_WAIT_POLICY" not in environ:
        chosen["OMP_WAIT_POLICY"] = "PASSIVE"
    local_ranks = int(environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if "OMP_NUM_THREADS" not in environ and local_ranks > 1:
        chosen["OMP_NUM_THREADS"] = str(max(_cores() // local_ranks, 1))
    environ.update(chosen)
    return chosen
