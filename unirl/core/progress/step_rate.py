"""Seconds per RL step for the run bar's rate and ETA: an exponential moving average of recent
steps, leaving out warm-up and checkpoint time.

A mean since the start is wrong twice over: the first step of a process pays for warm-up
(allocator, kernel selection, JIT builds, first weight sync), which on a GPU can be many
times a steady step (an ETA of 3:54 was shown at step 2 of 60 when 40 s remained), and the time
of a checkpoint save lands on the step that triggers it. So the first `warmup_steps` steps of a
process are measured but not averaged (they are the estimate only until a steady step exists),
time spent inside `excluded()` (checkpoints, exports) is subtracted from its step, and the
average weights recent steps (``alpha`` per step), since RL step time drifts with response
length.

    rate = StepRate(time.monotonic)
    ... one RL step ...
    with rate.excluded():
        save_checkpoint()
    rate.step_done()
    rate.seconds_per_step, rate.eta(steps_left)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

WARMUP_STEPS = 1
ALPHA = 0.3  # weight of the newest step: about the last 3-5 steps dominate


class StepRate:
    def __init__(
        self,
        clock: Callable[[], float],
        *,
        warmup_steps: int = WARMUP_STEPS,
        alpha: float = ALPHA,
    ) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"StepRate alpha={alpha} must be in (0, 1]")
        self._clock = clock
        self._warmup = warmup_steps
        self._alpha = alpha
        self._last = clock()
        self._excluded = 0.0
        self._steps = 0
        self._warmup_mean: float | None = None
        self._ema: float | None = None

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """Time spent inside does not count towards the step it happens in."""
        start = self._clock()
        try:
            yield
        finally:
            self._excluded += self._clock() - start

    def step_done(self) -> None:
        now = self._clock()
        seconds = max(now - self._last - self._excluded, 0.0)
        self._last, self._excluded = now, 0.0
        self._steps += 1
        if self._steps <= self._warmup:
            prev = self._warmup_mean or 0.0
            self._warmup_mean = prev + (seconds - prev) / self._steps
        elif self._ema is None:
            self._ema = seconds
        else:
            self._ema += self._alpha * (seconds - self._ema)

    @property
    def seconds_per_step(self) -> float | None:
        """The estimate: the moving average once a steady step exists, before that the
        warm-up steps' mean, and None before any step."""
        return self._ema if self._ema is not None else self._warmup_mean

    def eta(self, steps_left: int) -> float | None:
        per_step = self.seconds_per_step
        return None if per_step is None else per_step * max(steps_left, 0)
