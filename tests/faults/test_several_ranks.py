"""Faults of a job on two trainer ranks (torchrun, gloo), where one rank waits for work the other
does: an evaluation that hangs on rank 0, an environment that raises or hangs in an episode (run
once, on rank 0, and broadcast), and one of two vLLM engines killed. Each ends as the fault tier
promises (`tests/faults/conftest.py`): one named error line per rank within a bound, no process
left, the newest checkpoint intact and ``--resume`` finishing the run; the killed engine is
restarted and the run ends with the numbers of an uninterrupted one. Slow tier: each case starts
two-rank jobs (tens of seconds each on the 2-core CI machine; vLLM's start minutes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.faults.conftest import EXAMPLES, newest_checkpoint

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]


def _train_steps(run: Path) -> list[int]:
    from unirl.core.run.metrics_log import read_metrics

    return [int(r["step"]) for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


def _held_out(tmp_path: Path) -> Path:
    """4 prompts of the example's own file (its character tokenizer knows their characters)."""
    held = tmp_path / "held.jsonl"
    lines = (ROOT / "examples" / "math_prompts.jsonl").read_text().splitlines()[-4:]
    held.write_text("".join(json.dumps(json.loads(line)) + "\n" for line in lines))
    return held


def test_an_eval_that_hangs_on_rank0_is_named_by_the_waiting_rank(job, tmp_path):
    """Rank 0's evaluation after RL step 2 hangs: rank 1 stops after ``eval.timeout_s`` with one
    error line naming the evaluation and the key (not ``parallel.timeout_s``), the launcher ends
    rank 0, step 1's checkpoint is the newest, and --resume finishes the run."""
    run = tmp_path / "run"
    args = [
        "train", str(EXAMPLES / "tiny_math.yaml"), "--set", f"logging.run_dir={run}",
        "--set", "logging.tensorboard=false", "--set", "train.rl_steps=3",
        "--set", "checkpoint.every=1", "--set", "checkpoint.export_hf=false",
        "--set", "batch.prompts_per_rollout=4", "--set", "batch.samples_per_prompt=4",
        "--set", "batch.samples_per_optimizer_step=16", "--set", "batch.micro_batch_size=8",
        "--set", f"eval={{prompts: {_held_out(tmp_path)}, every: 1, timeout_s: 8}}",
        "--set", "parallel.timeout_s=120",
    ]  # fmt: skip
    failed = job(args, torchrun=2, fault="hang_eval:2", timeout=400)
    assert failed.returncode != 0
    lines = failed.error_lines()
    assert len(lines) == 1, failed.stderr[-3000:]
    assert lines[0].startswith(
        "unirl: error: rank 1 waited more than eval.timeout_s=8 s for the evaluation after RL "
        "step 2"
    ), lines[0]
    assert newest_checkpoint(run)[0] == 1
    done = job([*args, "--resume"], torchrun=2, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _train_steps(run) == [1, 2, 3]


@pytest.mark.parametrize(
    ("how", "words"),
    [("raise", "ValueError: the tool broke"), ("hang", "env_step_timeout_s=2")],
)
def test_an_environment_that_fails_on_rank0_stops_both_ranks(job, tmp_path, how, words):
    """Sampler episodes run on rank 0 only; its tool raises or hangs from RL step 2 on: the
    failure travels to rank 1, so each rank prints the same one line naming the episode's
    cause and step (rank 1 does not wait for a rank that failed), step 1's checkpoint is intact,
    and --resume on two ranks finishes once the tool works."""
    run, flag = tmp_path / "run", tmp_path / "broken"
    args = [
        "train", str(EXAMPLES / "tiny_multiturn.yaml"), "--set", f"logging.run_dir={run}",
        "--set", "logging.tensorboard=false", "--set", "train.rl_steps=3",
        "--set", "checkpoint.every=1", "--set", "checkpoint.export_hf=false",
        "--set", "rollout.env_step_timeout_s=2",
        "--set", "rollout.environment=tests.faults.environments:Breaks",
        "--set", f"rollout.environment_options={{flag: {flag}, how: {how}}}",
        "--set", "batch.prompts_per_rollout=4", "--set", "batch.samples_per_prompt=4",
        "--set", "batch.samples_per_optimizer_step=16", "--set", "batch.micro_batch_size=8",
    ]  # fmt: skip
    first = job([*args, "--set", "train.rl_steps=1"], torchrun=2, timeout=400)
    assert first.returncode == 0, first.stderr[-3000:]
    flag.write_text("")  # from now on the tool fails
    failed = job([*args, "--resume"], torchrun=2, timeout=400)
    assert failed.returncode != 0
    lines = failed.error_lines()
    assert len(lines) == 2 and lines[0] == lines[1], failed.stderr[-3000:]
    assert words in lines[0] and "RL step 2" in lines[0], lines[0]
    assert failed.seconds < 200, failed.seconds
    assert newest_checkpoint(run)[0] == 1
    flag.unlink()
    done = job([*args, "--resume"], torchrun=2, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _train_steps(run) == [1, 2, 3]
