"""The optimizer step's share of an RL step, timed apart (issue 49: where a step's time goes).

With the optimizer state in host memory the Adam step runs on the CPU once per optimizer step,
however many microbatches the step trains, so a step's MFU depends on how many sequences share
it. The throughput scripts wrap the backend's ``optimizer_step`` (what `unirl.core.step.RLStep`
calls once per optimizer step) for their timed steps only, and time it between two device
synchronisations: the wait before it is the backward's tail, which the step waits for anyway
(the gradients' norm reads them); the one after it, its copies back to the GPU, which the
harness waits for anyway (the optimizer step is the RL step's last GPU work, and each timed step
ends synchronised). The profiled steps run without the wrapper: its syncs would show as gaps.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any


class OptimizerTimes:
    """The wrapped ``optimizer_step``'s durations (s), one per call; ``mark`` / ``since`` sum
    the calls of one RL step."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    def mark(self) -> int:
        return len(self.calls)

    def since(self, mark: int) -> float:
        return sum(self.calls[mark:])


@contextlib.contextmanager
def optimizer_steps_timed(backend: Any, sync: Callable[[], None]) -> Iterator[OptimizerTimes]:
    """``backend.optimizer_step`` timed (module docstring) inside the block, as it was after."""
    times = OptimizerTimes()
    own = vars(backend).get("optimizer_step")  # an instance attribute already, or the class's
    step = backend.optimizer_step

    def timed_step(*args: Any, **kwargs: Any) -> Any:
        sync()
        t0 = time.perf_counter()
        out = step(*args, **kwargs)
        sync()
        times.calls.append(time.perf_counter() - t0)
        return out

    backend.optimizer_step = timed_step
    try:
        yield times
    finally:
        if own is None:
            del backend.optimizer_step
        else:
            backend.optimizer_step = own
