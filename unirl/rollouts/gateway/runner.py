"""The agent functions of a rollout, run concurrently, each within its timeout.

Each episode is the user's function called on a thread of its own as
``function(base_url, task, api_key)`` (an ``async def`` function is run to its end on that
thread's own event loop), at most ``rollout.agent.concurrency`` at once. What it returns is the
episode's reward: a number; None (the task's reward then scores the last call's completion); or
a mapping ``{"reward": x, "call_rewards": [r0, r1, ...]}`` with one reward per call, in call
order. Every episode ends with one named outcome:

    ok                        returned a reward after one call or more
    crashed                   raised (the exception is the episode's error)
    timeout                   no return within rollout.agent.episode_timeout_s (the thread is
                              abandoned: a daemon thread, which the exit does not wait for; its
                              later calls are refused as late calls)
    too_many_calls_in_flight  more calls at once than rollout.agent.max_calls_in_flight
    too_many_calls            more calls than rollout.agent.max_calls
    no_calls                  returned without calling the model (nothing to train on)
    bad_reward                returned something that is not a reward

An episode's outcome never touches another's: each has its own key, record and thread.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from unirl.core.errors import ConfigError
from unirl.rollouts.gateway.recording import CallRecord, EpisodeRecord

Agent = Callable[[str, dict[str, Any], str], Any]


def load_agent(spec: str) -> Agent:
    """The function ``"package.module:function"`` or ``"path/to/file.py:function"`` names
    (``rollout.agent.function``)."""
    module_name, _, name = spec.rpartition(":")
    try:
        if module_name.endswith(".py"):
            module = _module_from_file(module_name, spec)
        else:
            module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"rollout.agent.function={spec!r}: module {module_name!r} cannot be imported ({exc}); "
            "put it on PYTHONPATH or fix the name"
        ) from None
    agent = getattr(module, name, None)
    if not callable(agent):
        raise ConfigError(
            f"rollout.agent.function={spec!r}: {module_name} has no function {name!r}"
        )
    return agent


def _module_from_file(path: str, spec: str) -> Any:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"rollout.agent.function={spec!r}: {path} is not a file")
    module_spec = importlib.util.spec_from_file_location(f"unirl_agent_{file.stem}", file)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@attrs.frozen(kw_only=True)
class EpisodeResult:
    """How an episode ended: its calls, outcome, reward (None: the task scores it), per-call
    rewards, and the error of a failed one."""

    record: EpisodeRecord
    calls: list[CallRecord]
    outcome: str
    reward: float | None = None
    call_rewards: tuple[float, ...] | None = None
    error: str | None = None
    seconds: float = 0.0


def _reward_of(value: Any, calls: int) -> tuple[float | None, tuple[float, ...] | None, str | None]:
    """(reward, call rewards, error) of what the agent returned."""

    def number(x: Any) -> float | None:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            return None
        return float(x)

    if value is None:
        return None, None, None
    if isinstance(value, Mapping):
        reward = number(value.get("reward", 0.0))
        per_call = value.get("call_rewards")
        if per_call is None:
            return reward, None, None if reward is not None else f"reward {value.get('reward')!r}"
        rewards = [number(x) for x in per_call] if isinstance(per_call, Sequence) else [None]
        if reward is None or None in rewards or len(rewards) != calls:
            return (
                None,
                None,
                (
                    f"returned {value!r}; call_rewards must hold {calls} finite numbers (one per "
                    "call) and reward a finite number"
                ),
            )
        return reward, tuple(r for r in rewards if r is not None), None
    reward = number(value)
    if reward is None:
        return (
            None,
            None,
            (
                f"returned {value!r}; return a finite number, None (the task's reward) or "
                "{'reward': x, 'call_rewards': [...]}"
            ),
        )
    return reward, None, None


class _Running:
    def __init__(self, record: EpisodeRecord, deadline: float) -> None:
        self.record, self.deadline, self.started = record, deadline, time.monotonic()
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None


class AgentRunner:
    """Runs ``agent`` for a rollout's episodes: ``concurrency`` at once, each within
    ``timeout_s``."""

    def __init__(self, agent: Agent, *, concurrency: int, timeout_s: float) -> None:
        self.agent, self.concurrency, self.timeout_s = agent, concurrency, timeout_s

    def _target(
        self, run: _Running, base_url: str, task: dict[str, Any], cond: threading.Condition
    ) -> None:
        try:
            out = self.agent(base_url, task, run.record.key)
            run.value = asyncio.run(out) if inspect.isawaitable(out) else out
        except BaseException as exc:  # the episode's outcome, not this thread's end
            run.error = exc
        with cond:
            run.done = True
            cond.notify_all()

    def run(
        self,
        open_episode: Callable[[int], EpisodeRecord],
        end_episode: Callable[[EpisodeRecord], list[CallRecord]],
        base_url: str,
        tasks: Sequence[dict[str, Any]],
    ) -> list[EpisodeResult]:
        """Every task's episode, played to its outcome; results in task order."""
        cond = threading.Condition()
        results: list[EpisodeResult | None] = [None] * len(tasks)
        waiting = list(range(len(tasks)))
        active: dict[int, _Running] = {}
        while waiting or active:
            while waiting and len(active) < self.concurrency:
                i = waiting.pop(0)
                run = _Running(open_episode(i), time.monotonic() + self.timeout_s)
                active[i] = run
                threading.Thread(
                    target=self._target, args=(run, base_url, dict(tasks[i]), cond),
                    name=f"unirl-agent-{i}", daemon=True,
                ).start()  # fmt: skip
            with cond:
                now = time.monotonic()
                if not any(r.done or r.deadline <= now for r in active.values()):
                    cond.wait(timeout=min(r.deadline for r in active.values()) - now)
            now = time.monotonic()
            for i, run in list(active.items()):
                if run.done or run.deadline <= now:
                    del active[i]
                    results[i] = self._result(run, end_episode(run.record), timed_out=not run.done)
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def _result(self, run: _Running, calls: list[CallRecord], *, timed_out: bool) -> EpisodeResult:
        fields = {"record": run.record, "calls": calls, "seconds": time.monotonic() - run.started}
        if run.record.failure is not None:  # a request limit broken: whatever came after
            f = run.record.failure
            return EpisodeResult(outcome=f.outcome, error=str(f), **fields)
        if timed_out:
            return EpisodeResult(
                outcome="timeout",
                error=f"the agent did not return within rollout.agent.episode_timeout_s="
                f"{self.timeout_s:g} s (it hangs)",
                **fields,
            )
        if run.error is not None:
            e = run.error
            return EpisodeResult(outcome="crashed", error=f"{type(e).__name__}: {e}", **fields)
        if not calls:
            return EpisodeResult(
                outcome="no_calls", error="the agent returned without calling the model", **fields
            )
        reward, call_rewards, error = _reward_of(run.value, len(calls))
        if error is not None:
            return EpisodeResult(outcome="bad_reward", error=f"the agent {error}", **fields)
        return EpisodeResult(outcome="ok", reward=reward, call_rewards=call_rewards, **fields)
