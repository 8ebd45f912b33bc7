"""Faults of the run around the trainer: the disk fills while a checkpoint is written, a rank is
killed while the async worker generates, an environment raises or hangs in an episode. Each ends
with its named error (or, for a killed rank, the job ends within ``parallel.timeout_s``), no process
left, the newest checkpoint intact, and ``--resume`` continuing from it."""

from __future__ import annotations

import pytest

from tests.faults.conftest import EXAMPLES, metric_steps, newest_checkpoint

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")


def _tiny(run, *extra: str) -> list[str]:
    return [
        "train", str(EXAMPLES / "tiny_grpo.yaml"), "--set", f"logging.run_dir={run}",
        "--set", "logging.tensorboard=false", "--set", "train.rl_steps=3",
        "--set", "checkpoint.every=1", "--set", "batch.prompts_per_rollout=4",
        "--set", "batch.samples_per_optimizer_step=32", "--set", "batch.micro_batch_size=16",
        *extra,
    ]  # fmt: skip


def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one(job, tmp_path):
    run = tmp_path / "run"
    failed = job(_tiny(run), fault="disk_full_at_checkpoint:2", timeout=300)
    assert failed.returncode == 2, failed.stderr[-3000:]
    [line] = failed.error_lines()
    assert "No space left on device" in line and "step_0000002" in line, line
    assert "--resume" in line  # the fix names how to continue
    step, _ = newest_checkpoint(run)
    assert step == 1  # the half-written step 2 is a .partial that resume never picks
    done = job([*_tiny(run), "--resume"], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert metric_steps(run) == [1, 2, 3]


def test_a_rank_killed_while_its_worker_generates_ends_the_job(job, tmp_path):
    """Two ranks, rollouts generated one ahead; rank 1 dies (SIGKILL) as its worker starts
    rollout 3 (queued in step 3, after step 2's checkpoint on rank 1, so step 1's is published).
    The launcher names rank 1's signal as the root cause and stops rank 0; a rank 0 that sees
    the closed connection first says so in one error line (a lost rank), never with gloo's
    traceback. The job ends within the process group's timeout, no rank is left, and --resume
    on two ranks finishes the run."""
    run = tmp_path / "run"
    args = _tiny(run, "--set", "train.max_staleness=1", "--set", "parallel.timeout_s=30",
                 "--set", "batch.micro_batch_size=8", "--set", "train.rl_steps=4")  # fmt: skip
    failed = job(args, torchrun=2, fault="kill_rank_in_worker:1,3", timeout=300)
    assert failed.returncode != 0
    assert failed.seconds < 200, failed.seconds
    assert "exitcode  : -9" in failed.stderr and "rank      : 1" in failed.stderr
    assert all("lost another rank" in line for line in failed.error_lines()), failed.stderr
    assert "[rank0]: Traceback" not in failed.stderr
    step, _ = newest_checkpoint(run)
    assert step >= 1
    done = job([*args, "--resume"], torchrun=2, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert metric_steps(run)[-1] == 4


@pytest.mark.parametrize(
    ("how", "words"),
    [("raise", "ValueError: the tool broke"), ("hang", "env_step_timeout_s=2")],
)
def test_an_environment_that_fails_is_named_and_resume_continues(job, tmp_path, how, words):
    run = tmp_path / "run"
    flag = tmp_path / "broken"
    args = [
        "train", str(EXAMPLES / "tiny_multiturn.yaml"), "--set", f"logging.run_dir={run}",
        "--set", "logging.tensorboard=false", "--set", "train.rl_steps=3",
        "--set", "checkpoint.every=1", "--set", "rollout.env_step_timeout_s=2",
        "--set", "rollout.environment=tests.faults.environments:Breaks",
        "--set", f"rollout.environment_options={{flag: {flag}, how: {how}}}",
    ]  # fmt: skip
    first = job([*args, "--set", "train.rl_steps=1"], timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    flag.write_text("")  # from now on the tool fails
    failed = job([*args, "--resume"], timeout=300)
    assert failed.returncode == 2, failed.stderr[-3000:]
    [line] = failed.error_lines()
    assert words in line and "RL step 2" in line, line
    assert newest_checkpoint(run)[0] == 1
    flag.unlink()
    done = job([*args, "--resume"], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert metric_steps(run) == [1, 2, 3]


@pytest.mark.parametrize(
    ("how", "words"),
    [
        # a crash is also a unit test (tests/unit/test_gateway_agent.py); a hang is the job's
        pytest.param("raise", "ended as crashed: ValueError: the agent's tool broke",
                     marks=pytest.mark.slow),
        ("hang", "ended as timeout: the agent did not return within rollout.agent.episode_timeout_s=3"),
    ],
)  # fmt: skip
def test_an_agent_that_fails_is_named_and_resume_continues(job, tmp_path, how, words):
    """rollout.source: agent; the agent function raises or hangs from RL step 2 on: one error
    line naming the episode, its outcome and the fix, no process left (the hung agent's thread
    is abandoned), step 1's checkpoint intact, and --resume finishing once the agent is fixed."""
    run = tmp_path / "run"
    flag = tmp_path / "broken"
    args = [
        "train", str(EXAMPLES / "tiny_agent.yaml"), "--set", f"logging.run_dir={run}",
        "--set", "logging.tensorboard=false", "--set", "train.rl_steps=3",
        "--set", "checkpoint.every=1", "--set", "rollout.agent.episode_timeout_s=3",
        "--set", "rollout.agent.function=tests.faults.agents:agent",
        "--set", "batch.prompts_per_rollout=4", "--set", "batch.samples_per_prompt=4",
        "--set", "batch.samples_per_optimizer_step=16", "--set", "batch.micro_batch_size=16",
    ]  # fmt: skip
    env = {"UNIRL_AGENT_FLAG": str(flag), "UNIRL_AGENT_HOW": how, "OMP_NUM_THREADS": "1"}
    first = job([*args, "--set", "train.rl_steps=1"], timeout=300, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    flag.write_text("")  # from now on the agent fails
    failed = job([*args, "--resume"], timeout=300, env=env)
    assert failed.returncode == 2, failed.stderr[-3000:]
    [line] = failed.error_lines()
    assert words in line and "RL step 2 episode" in line, line
    assert "rollout.agent.failure_reward" in line  # the fix
    assert newest_checkpoint(run)[0] == 1
    flag.unlink()
    done = job([*args, "--resume"], timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert metric_steps(run) == [1, 2, 3]
