"""The engine watch (unirl/rollouts/vllm/health.py) on a stand-in engine: a plain child process
and a call that blocks. A process killed mid-call is a dead engine within a poll; a call with no
progress for the stall timeout is a hung engine; progress (an engine step) keeps a long call
alive; an engine idle between calls (the trainer training) is not hung. Times are measured from
the fault, against bounds written here."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("psutil")

from unirl.rollouts.vllm.health import POLL_S, WATCHED, EngineFailure, EngineWatch


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_process_killed_during_a_call_is_a_dead_engine_within_a_poll(child):
    watch = EngineWatch({child.pid}, stall_timeout_s=60.0)
    killed: list[float] = []

    def kill() -> None:
        killed.append(time.monotonic())
        child.kill()

    threading.Timer(0.3, kill).start()
    with pytest.raises(EngineFailure, match=rf"its process {child.pid} is gone") as err:
        watch.call(threading.Event().wait, what="generate")  # blocks for ever
    assert err.value.kind == "died"
    assert time.monotonic() - killed[0] < 3 * POLL_S + 0.5
    with pytest.raises(EngineFailure):  # a failed engine fails every later call at once
        watch.call(lambda: 1, what="generate")


def test_a_call_without_progress_is_a_hung_engine_after_the_stall_timeout(child):
    watch = EngineWatch({child.pid}, stall_timeout_s=1.0)
    start = time.monotonic()
    with pytest.raises(EngineFailure, match=r"no progress for rollout.vllm.stall_timeout_s=1 s"):
        watch.call(threading.Event().wait, what="generate")
    assert 1.0 <= time.monotonic() - start < 1.0 + 3 * POLL_S + 0.5


def test_progress_keeps_a_long_call_alive_and_idle_time_between_calls_is_no_stall(child):
    watch = EngineWatch({child.pid}, stall_timeout_s=1.0)

    def steps() -> str:  # 2.4 s in all, an engine step every 0.4 s
        for _ in range(6):
            time.sleep(0.4)
            watch.progressed()
        return "done"

    assert watch.call(steps, what="generate") == "done"
    time.sleep(1.5)  # the trainer trains; the engine waits
    assert watch.call(lambda: 7, what="collective_rpc") == 7


def test_the_engines_adapter_calls_are_watched_too(child):
    """``llm.llm_engine.add_lora`` / ``remove_lora`` / ``list_loras`` wait for the engine core as
    generate does (unirl serve loads every sampler weights' adapter with them, unirl train each
    policy version's): on a hung engine they fail after the stall timeout, not never."""
    from types import SimpleNamespace

    blocks = threading.Event().wait  # a hung engine core: the call never returns
    llm_engine = SimpleNamespace(step=lambda: [], add_lora=lambda request: blocks(),
                                 remove_lora=lambda lora_id: blocks(), list_loras=blocks)  # fmt: skip
    llm = SimpleNamespace(llm_engine=llm_engine, **{n: blocks for n in WATCHED})
    watch = EngineWatch({child.pid}, stall_timeout_s=0.5)
    watch.install(llm)
    outcome: list[BaseException] = []

    def add() -> None:
        try:
            llm.llm_engine.add_lora("request")
        except BaseException as exc:
            outcome.append(exc)

    caller = threading.Thread(target=add, daemon=True)
    caller.start()
    caller.join(timeout=0.5 + 3 * POLL_S + 1.0)
    assert not caller.is_alive(), "add_lora on a hung engine waited past the stall timeout"
    assert isinstance(outcome[0], EngineFailure) and outcome[0].kind == "hung"
    for call in (lambda: llm.llm_engine.remove_lora(1), llm.llm_engine.list_loras):
        with pytest.raises(EngineFailure):  # the failed engine fails them at once
            call()
