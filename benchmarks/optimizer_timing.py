"""The optimizer step's share of an RL step, timed apart (issue 49: where a step's time goes).

With the optimizer state in host memory the Adam step runs on the CPU once per optimizer step,
however many microbatches the step trains, so a step's MFU depends on how many sequences share
it. The throughput scripts wrap the backend's ``optimizer_step`` (what `unirl.core.step.RLStep`
calls once per optimizer step) to time it between two device synchronisations; the wait before
it is the backward's tail, which the step waits for anyway (the gradients' norm reads them).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def time_optimizer_steps(backend: Any, sync: Callable[[], None]) -> list[float]:
    """Wrap ``backend.optimizer_step``; the returned list gets one duration (s) per call."""
    durations: list[float] = []
    step = backend.optimizer_step

    def timed_step(*args: Any, **kwargs: Any) -> Any:
        sync()
        t0 = time.perf_counter()
        out = step(*args, **kwargs)
        sync()
        durations.append(time.perf_counter() - t0)
        return out

    backend.optimizer_step = timed_step
    return durations
