"""rollout.reward_workers: the reward in spawned worker processes, one sample per call, with a
per-sample time limit; a timeout, a dead worker or a raising call is a named error for that
sample or the configured rollout.reward_on_error, and the job never hangs. One pool of two
workers per test (each start is an interpreter and an import)."""

import time

import pytest

from unirl.core.config.run_config import config_from_dict
from unirl.core.errors import ConfigError, RolloutDataError
from unirl.rollouts.rewards.registry import NamedReward, RewardRun
from unirl.rollouts.rewards.workers import RewardCrashError, RewardError, RewardTimeoutError

MODULE = "tests.unit.worker_rewards"


def _score(reward, metadata):
    n = len(metadata)
    return reward(
        [f"p{i}" for i in range(n)],
        [f"r{i}" for i in range(n)],
        metadata,
        prompt_tokens=[[1]] * n,
        response_tokens=[[2]] * n,
        origins=[f"prompts.jsonl line {i + 1}" for i in range(n)],
    )


def _reward(name, on_error="raise", timeout_s=None, **options):
    run = RewardRun(workers=2, timeout_s=timeout_s, on_error=on_error)
    return NamedReward(f"{MODULE}:{name}", options, run)


def test_a_timeout_a_dead_worker_and_a_raising_call_are_named_errors_for_their_sample():
    reward = _reward("misbehaves", timeout_s=1.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(
            RewardTimeoutError, match=r"sample 1 \(prompts.jsonl line 2.*reward_timeout_s=1.0"
        ):
            _score(reward, [{}, {"slow": True}, {}])
        assert time.monotonic() - t0 < 30  # the sleeper (60 s) was killed, not waited for
        with pytest.raises(RewardCrashError, match=r"sample 0 .*exit code 7"):
            _score(reward, [{"exit": True}])
        with pytest.raises(RolloutDataError, match=r"sample 1 .*ValueError: cannot score this one"):
            _score(reward, [{}, {"raise": True}])
    finally:
        reward.close()


def test_with_reward_on_error_a_failure_costs_only_its_sample():
    reward = _reward("misbehaves", on_error=-1.0, timeout_s=1.0)
    try:
        metadata = [{}, {"slow": True}, {}, {"exit": True}, {"raise": True}, {}]
        assert _score(reward, metadata) == [4.0, -1.0, 4.0, -1.0, -1.0, 4.0]
        # the killed and the dead workers were replaced: the next rollout is scored in full
        assert _score(reward, [{}, {}, {}]) == [4.0, 4.0, 4.0]
    finally:
        reward.close()


def test_a_reward_may_start_processes_and_none_outlives_its_worker(tmp_path):
    reward = _reward("in_a_child_process")
    try:
        # r0, r1: len 2 each, doubled in a child process of the worker
        assert _score(reward, [{}, {}]) == [4.0, 4.0]
    finally:
        reward.close()
    pid_file = tmp_path / "sleeper.pid"
    reward = _reward("leaves_a_process_and_hangs", timeout_s=2.0, pid_file=str(pid_file))
    try:
        with pytest.raises(RewardTimeoutError):
            _score(reward, [{}])
    finally:
        reward.close()
    sleeper = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(sleeper) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(sleeper), "the process the timed-out reward started is still running"


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a killed child not reaped yet is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_reward_that_fails_on_every_sample_stops_the_run_despite_reward_on_error():
    reward = _reward("misbehaves", on_error=-1.0)
    try:
        with pytest.raises(RewardError, match=r"every one of the 2 samples.*error 2.*cannot score"):
            _score(reward, [{"raise": True}, {"raise": True}])
    finally:
        reward.close()


def test_a_reward_that_cannot_reach_a_worker_is_refused_when_built():
    import tests.unit.worker_rewards as module

    module.local = lambda *a, **k: [0.0]  # a lambda pickles by name only if it has one
    try:
        with pytest.raises(ConfigError, match=r"module-level function"):
            _reward("local")
    finally:
        del module.local


def _cfg(**rollout):
    return config_from_dict(
        {
            "model": {"hf_config": {"model_type": "llama"}},
            "batch": {"micro_batch_size": 2},
            "rollout": {"prompts": "p.jsonl", "reward": "math_answer", **rollout},
        }
    )


def test_the_config_keys():
    assert (
        _cfg(reward_workers=2, reward_timeout_s=3, reward_on_error=0).rollout.reward_on_error == 0.0
    )
    with pytest.raises(
        ConfigError, match=r"rollout.reward_timeout_s=5.0 .* rollout.reward_workers"
    ):
        _cfg(reward_timeout_s=5)
    with pytest.raises(ConfigError, match=r"rollout.reward_on_error=0.0 .* rollout.reward_workers"):
        _cfg(reward_on_error=0)
    with pytest.raises(ConfigError, match=r"rollout.reward_on_error"):
        _cfg(reward_workers=1, reward_on_error="zero")
    with pytest.raises(ConfigError, match=r"rollout.reward_workers"):
        config_from_dict({"model": {"hf_config": {"model_type": "llama"}},
                          "batch": {"micro_batch_size": 2}, "rollout": {"reward_workers": 1}})  # fmt: skip


@pytest.mark.slow
def test_a_run_scores_in_its_workers_and_leaves_none_behind(tmp_path):
    """`unirl train` with rollout.reward_workers: 1: every sample is scored in the worker (one
    call each, another process), and the worker is gone when the run returns."""
    pytest.importorskip("deepspeed", reason="needs deepspeed (pip install unirl[deepspeed])")
    import json
    import os

    from unirl.train import train

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": f"{a}+1=", "metadata": {"answer": a + 1}}) + "\n"
            for a in range(3)
        )
    )
    log = tmp_path / "calls.txt"
    tiny = {"model_type": "llama", "vocab_size": 32, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 64}  # fmt: skip
    cfg = config_from_dict(
        {
            "backend": "deepspeed",
            "model": {"hf_config": tiny, "max_seq_len": 16, "init_seed": 1, "dtype": "fp32"},
            "batch": {"prompts_per_rollout": 2, "samples_per_prompt": 2,
                      "samples_per_optimizer_step": 4, "micro_batch_size": 4},
            "parallel": {"world_size": 1},
            "rollout": {"prompts": str(prompts), "reward": f"{MODULE}:counted_length",
                        "reward_options": {"log": str(log)}, "max_new_tokens": 3,
                        "reward_workers": 1, "reward_timeout_s": 60},
            "train": {"rl_steps": 2},
            "logging": {"run_dir": str(tmp_path / "run"), "tensorboard": False},
            "checkpoint": {"export_hf": False},
            "progress": {"enabled": False},
        }
    )  # fmt: skip
    summary = train(cfg)
    calls = [line.split() for line in log.read_text().splitlines()]
    assert [n for n, _ in calls] == ["1"] * 8  # 2 rollouts x 4 samples, one call each
    pids = {int(pid) for _, pid in calls}
    assert len(pids) == 1 and os.getpid() not in pids
    assert summary.steps_done == 2
    with pytest.raises(ProcessLookupError):  # the worker was stopped with the run
        os.kill(pids.pop(), 0)


def test_a_run_that_stops_at_a_failure_does_not_wait_out_the_later_samples():
    """With reward_on_error: raise the first failure ends the scoring: eight slow samples on two
    workers with a 1 s limit took every sample's timeout (4 s) before the error; now the
    workers stop at the first (their busy samples are dropped)."""
    reward = _reward("misbehaves", timeout_s=1.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(RewardTimeoutError, match=r"timed out on sample 0 "):
            _score(reward, [{"slow": True}] * 8)
        assert time.monotonic() - t0 < 3.0
        assert _score(reward, [{}, {}]) == [4.0, 4.0]  # the workers were replaced
    finally:
        reward.close()


@pytest.mark.parametrize(
    ("workers", "timeout_s", "samples", "expected"),
    [
        # ceil(10 / 4) = 3 samples per worker: 120 (first start) + 3 x (30 + 120) + 30 slack
        (4, 30.0, 10, 600.0),
        # one sample per worker: 120 + 1 x (5 + 120) + 30
        (8, 5.0, 8, 275.0),
        (2, None, 8, None),  # no time limit on rank 0: nothing to derive a bound from
        (0, None, 8, None),  # in the training process
    ],
)
def test_the_waiting_ranks_bound_on_the_rewards_is_what_bounds_them_on_rank0(
    workers, timeout_s, samples, expected
):
    bound = RewardRun(workers=workers, timeout_s=timeout_s, on_error="raise").wait_bound(samples)
    assert (bound if bound is None else bound[0]) == expected
    if bound is not None:
        assert f"rollout.reward_timeout_s={timeout_s:g}" in bound[1]


def test_check_prints_each_wait_for_rank0s_work():
    """`unirl check`'s rank0_waits line: tiny_math's 16 x 8 = 128 samples on 2 workers are 64
    per worker: 120 + 64 x (5 + 120) + 30 = 8150 s; the hook's own key; vLLM scores with the
    rollout (its generation timeout's wait)."""
    from pathlib import Path

    from unirl.core.config.run_config import load_config
    from unirl.rollouts.check import rank0_waits_note

    examples = Path(__file__).parents[2] / "examples"
    sets = ["rollout.reward_workers=2", "rollout.reward_timeout_s=5",
            f"algorithm.rollout_postprocess_hook={MODULE}:counted_hook",
            "algorithm.rollout_postprocess_timeout_s=90"]  # fmt: skip
    note = rank0_waits_note(load_config(examples / "tiny_math.yaml", sets))
    assert "the rewards at most 8150 s (rollout.reward_timeout_s=5 for each of 64 samples" in note
    assert "the hook at most algorithm.rollout_postprocess_timeout_s=90 s" in note
    vllm = rank0_waits_note(load_config(examples / "tiny_grpo_vllm.yaml", []))
    assert "the rewards within the rollout's own wait" in vllm
