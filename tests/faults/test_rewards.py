"""Faults of a reward run in worker processes (``rollout.reward_workers``): a worker that crashes,
hangs past ``rollout.reward_timeout_s``, or starts processes and hangs. Each ends the run with one
``unirl: error:`` line naming the sample and the cause, no process left (the worker's own children
included), the checkpoint of the last finished step intact, and ``--resume`` finishing the run."""

from __future__ import annotations

import pytest

from tests.faults.conftest import EXAMPLES, metric_steps, newest_checkpoint

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")


def _args(run, tmp_path, *, how: str, after: int, timeout_s: float | None = None) -> list[str]:
    options = f"{{counter: {tmp_path / 'calls'}, after: {after}, how: {how}}}"
    args = [
        "train", str(EXAMPLES / "tiny_math.yaml"), "--set", f"logging.run_dir={run}",
        "--set", "logging.tensorboard=false", "--set", "train.rl_steps=4",
        "--set", "checkpoint.every=1", "--set", "batch.prompts_per_rollout=4",
        "--set", "batch.samples_per_optimizer_step=32", "--set", "rollout.reward_workers=1",
        "--set", "rollout.reward=tests.faults.rewards:math_then",
        "--set", f"rollout.reward_options={options}",
    ]  # fmt: skip
    if timeout_s is not None:
        args += ["--set", f"rollout.reward_timeout_s={timeout_s}"]
    return args


@pytest.mark.parametrize(
    ("how", "timeout_s", "words"),
    [
        ("crash", None, "crashed its worker process on sample 0"),
        ("hang", 2.0, "timed out on sample 0"),
        ("spawn", 2.0, "timed out on sample 0"),  # and its sleeper is killed with the worker
    ],
)
def test_a_failing_reward_ends_the_run_named_and_resume_finishes_it(
    job, tmp_path, how, timeout_s, words
):
    run = tmp_path / "run"
    # 4 prompts x 8 samples = 32 calls a step: the 65th call (step 3's first) fails
    failed = job(_args(run, tmp_path, how=how, after=64, timeout_s=timeout_s), timeout=300)
    assert failed.returncode == 2, failed.stderr[-3000:]
    [line] = failed.error_lines()
    assert "rollout.reward='tests.faults.rewards:math_then'" in line and words in line, line
    assert "Traceback" not in failed.stderr
    assert failed.seconds < 120, failed.seconds  # the hang is bounded by its timeout, not 600 s
    step, _ = newest_checkpoint(run)
    assert step == 2 and metric_steps(run) == [1, 2]
    done = job([*_args(run, tmp_path, how=how, after=10**9), "--resume"], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert metric_steps(run) == [1, 2, 3, 4]
