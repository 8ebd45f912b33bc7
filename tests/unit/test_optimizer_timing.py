"""`benchmarks/optimizer_timing.py`: the optimizer step timed per call inside the block only (the
profiled steps after it run the backend's own method, without the wrapper's syncs)."""

from __future__ import annotations

import time

from benchmarks.optimizer_timing import optimizer_steps_timed


class _Backend:
    def __init__(self) -> None:
        self.steps = 0

    def optimizer_step(self, pause: float = 0.02) -> int:
        time.sleep(pause)
        self.steps += 1
        return self.steps


def test_each_call_is_timed_and_summed_per_rl_step_inside_the_block():
    backend, syncs = _Backend(), []
    with optimizer_steps_timed(backend, lambda: syncs.append(1)) as times:
        mark = times.mark()
        assert backend.optimizer_step() == 1 and backend.optimizer_step(pause=0.05) == 2
        two = times.since(mark)
        mark = times.mark()
        assert times.since(mark) == 0.0  # an RL step without an optimizer step
    assert len(times.calls) == 2 and len(syncs) == 4  # one sync before and after each call
    assert times.calls[0] >= 0.02 and times.calls[1] >= 0.05
    assert two == times.calls[0] + times.calls[1]
    # after the block: the class's method again, untimed
    assert "optimizer_step" not in vars(backend)
    backend.optimizer_step()
    assert len(times.calls) == 2 and backend.steps == 3


def test_an_instance_attribute_is_put_back():
    backend = _Backend()
    own = backend.optimizer_step  # a bound method stored on the instance
    backend.optimizer_step = own
    with optimizer_steps_timed(backend, lambda: None) as times:
        backend.optimizer_step(pause=0.0)
    assert backend.optimizer_step is own and len(times.calls) == 1
