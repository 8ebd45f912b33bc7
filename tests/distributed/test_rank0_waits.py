"""What runs once on global rank 0 (`unirl.rollouts.once`) is waited for on a group of its own,
bounded by its own timeout, never by a training collective's (issue 44 items 1 and 4).

The training group here has a 3-second timeout (what ``parallel.timeout_s: 3`` gives it): an
evaluation of 4 s on rank 0 still ends with rank 0's metrics on both ranks (reward mean 3/6, as
`tests/unit/test_eval.py` computes it by hand), and the training group works after it; an
evaluation longer than ``eval.timeout_s`` is one error on rank 1 naming that key; a
post-processing hook of 4.5 s finishes too, and one past ``algorithm.rollout_postprocess_timeout_s``
is one error on rank 1 naming that key. Rewards in worker processes that take 4 s finish; rank 0
stuck past the bound their own timeouts give is one error on rank 1 naming that bound. Multi-turn
episodes on the built-in sampler run once, on rank 0, with an environment whose observations and
rewards depend on the process that plays it: one process played, both ranks hold its batch.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs transformers (pip install unirl[hf])")

from tests.spawn import run_distributed
from tests.unit.test_eval import HELD_OUT, _data, _SetResponses, _write

TRAINING_TIMEOUT_S = 3.0


def _short_training_group(rank: int, world: int, store: str) -> None:
    """The default group again, with the short timeout ``parallel.timeout_s`` would give it."""
    import torch.distributed as dist

    dist.destroy_process_group()
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=TRAINING_TIMEOUT_S),
    )


class _SlowResponses(_SetResponses):
    """`_SetResponses` that takes ``delay_s`` per call (the eval calls it twice)."""

    def __init__(self, task, texts, delay_s):
        super().__init__(task, texts)
        self.delay_s = delay_s

    def generate_eval(self, prompts, **kwargs):
        time.sleep(self.delay_s)
        return super().generate_eval(prompts, **kwargs)


def _eval_rank(rank: int, world: int, tmp: str, delay_s: float, timeout_s: float) -> dict:
    import torch
    import torch.distributed as dist

    from unirl.core.config.run_config import config_from_dict
    from unirl.rollouts.build import build_task
    from unirl.rollouts.eval.evaluator import Evaluator

    torch.set_num_threads(1)
    _short_training_group(rank, world, f"{tmp}/store")
    tmp_path = Path(tmp) / f"rank{rank}"
    tmp_path.mkdir()
    held = _write(tmp_path / "held.jsonl", HELD_OUT)
    section = {"prompts": held, "samples_per_prompt": 2, "timeout_s": timeout_s}
    cfg = config_from_dict(_data(tmp_path, eval_section=section))
    engine = _SlowResponses(build_task(cfg), ["3", "1", "2", "4", "5", "5"], delay_s)
    try:
        metrics = Evaluator(cfg, engine).run(1)
    except Exception as exc:  # rank 0 may fail too once rank 1 gave up: reported, not raised
        return {"error": f"{type(exc).__name__}: {exc}", "calls": len(engine.calls)}
    total = torch.ones(1)
    dist.all_reduce(total)  # the training group still works
    return {"metrics": metrics, "calls": len(engine.calls), "total": float(total.item())}


def test_an_eval_longer_than_the_training_timeout_finishes(tmp_path):
    r0, r1 = run_distributed(_eval_rank, 2, str(tmp_path), 2.0, 60.0)
    assert "error" not in r0 and "error" not in r1, (r0, r1)
    # rank 0 evaluated (2 chunks), rank 1 received: answers 3, 6, 5 -> 3 of 6 right
    assert (r0["calls"], r1["calls"]) == (2, 0)
    assert r0["metrics"] == r1["metrics"]
    assert r1["metrics"]["eval/reward_mean"] == pytest.approx(3 / 6)
    assert r1["metrics"]["time/eval_s"] >= 2 * 2.0 > TRAINING_TIMEOUT_S
    assert r0["total"] == r1["total"] == 2.0


def test_an_eval_longer_than_eval_timeout_is_one_named_error(tmp_path):
    _, r1 = run_distributed(_eval_rank, 2, str(tmp_path), 2.0, 1.0)
    assert r1["error"].startswith(
        "WaitTimeoutError: rank 1 waited more than eval.timeout_s=1 s for the evaluation after RL step 1"
    ), r1


def slow_hook(batch, *, rl_step):
    """Every reward 7.0, after a wait longer than the training group's timeout."""
    import attrs

    from unirl.core.data.rollout import RolloutBatch

    time.sleep(TRAINING_TIMEOUT_S + 1.5)
    return RolloutBatch(tuple(attrs.evolve(s, reward=7.0) for s in batch.samples))


def _hook_rank(rank: int, world: int, tmp: str, timeout_s: float = 60.0) -> dict:
    import torch
    import torch.distributed as dist

    from unirl.core.data.rollout import RolloutBatch
    from unirl.rollouts.postprocess import apply_postprocess_hook

    _short_training_group(rank, world, f"{tmp}/store")
    batch = RolloutBatch.from_records(
        [{"prompt_tokens": [1, 2], "response_tokens": [3], "reward": 0.0, "group_id": 0}] * 2
    )
    t0 = time.monotonic()
    try:
        hooked = apply_postprocess_hook(slow_hook, batch, 0, "slow_hook", timeout_s=timeout_s)
    except Exception as exc:  # rank 0 may fail too once rank 1 gave up: reported, not raised
        return {"error": f"{type(exc).__name__}: {exc}", "waited": time.monotonic() - t0}
    waited = time.monotonic() - t0
    total = torch.ones(1)
    dist.all_reduce(total)  # the training group still works
    return {"rewards": [s.reward for s in hooked.samples], "waited": waited, "total": total.item()}


def test_a_hook_longer_than_the_training_timeout_finishes(tmp_path):
    r0, r1 = run_distributed(_hook_rank, 2, str(tmp_path))
    assert r0["rewards"] == r1["rewards"] == [7.0, 7.0]
    assert r1["waited"] > TRAINING_TIMEOUT_S and r0["total"] == r1["total"] == 2.0


def test_a_hook_past_its_own_timeout_is_one_named_error_on_the_waiting_rank(tmp_path):
    _, r1 = run_distributed(_hook_rank, 2, str(tmp_path), 1.0)
    assert r1["error"].startswith(
        "WaitTimeoutError: rank 1 waited more than algorithm.rollout_postprocess_timeout_s=1 s for "
        "algorithm.rollout_postprocess_hook='slow_hook' on the rollout of RL step 1"
    ), r1
    assert r1["waited"] < TRAINING_TIMEOUT_S + 1.5  # it did not wait for the hook's end


def _reward_rank(rank: int, world: int, tmp: str, seconds: float, timeout_s: float) -> dict:
    """Rollout 0 of a prompt file scored by `worker_rewards.sleeps` (``seconds`` per sample) in
    2 reward workers, each sample within ``timeout_s``. With ``seconds`` 0, rank 0 stalls 6 s
    before it scores (stuck outside the reward's own bound), and rank 1 derives its bound with a
    0.5-s worker start and 0.5-s slack instead of 120 s and 30 s."""
    import json

    import torch

    from tests.tiny_models import TINY_BATCH, TINY_LLAMA
    from unirl.core.config.run_config import config_from_dict
    from unirl.rollouts import build_rollout_source
    from unirl.rollouts.rewards import registry

    torch.set_num_threads(1)
    _short_training_group(rank, world, f"{tmp}/store")
    prompts = Path(tmp) / f"p{rank}.jsonl"
    rows = [{"prompt": f"{a}+{a}=", "metadata": {"answer": 2 * a}} for a in (1, 2, 3)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    hf = {**TINY_LLAMA, "vocab_size": 32, "num_hidden_layers": 1}
    cfg = config_from_dict(
        {
            "model": {"hf_config": hf, "max_seq_len": 16, "init_seed": 1},
            "batch": dict(TINY_BATCH),
            "parallel": {"world_size": world},
            "rollout": {"prompts": str(prompts), "reward": "tests.unit.worker_rewards:sleeps",
                        "reward_options": {"seconds": seconds}, "max_new_tokens": 4,
                        "reward_workers": 2, "reward_timeout_s": timeout_s},
        }
    )  # fmt: skip
    source = build_rollout_source(cfg)
    if seconds == 0 and rank == 0:
        scored = source.task.reward_fn

        def stalled(*args, **kwargs):
            time.sleep(6.0)
            return [0.0] * len(args[0])

        stalled.run = scored.run  # type: ignore[attr-defined]
        source.task.reward_fn = stalled
    elif seconds == 0:
        registry.STARTUP_TIMEOUT_S, registry.WAIT_SLACK_S = 0.5, 0.5
    t0 = time.monotonic()
    try:
        batch = source.next_rollout(0)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "waited": time.monotonic() - t0}
    finally:
        if seconds == 0 and rank == 0:
            source.task.reward_fn = scored
        source.close()
    waited = time.monotonic() - t0
    return {
        "rewards": [s.reward for s in batch.samples],
        "lengths": [float(len(s.metadata["response"])) for s in batch.samples],
        "waited": waited,
    }


@pytest.mark.slow  # 13 s (2 worker starts per rank); it guards what worked before the bound
def test_rewards_longer_than_the_training_timeout_finish_within_their_own_bound(tmp_path):
    # 4 samples on 2 workers, 2 s each: 4 s on rank 0, beyond the training group's 3 s
    r0, r1 = run_distributed(_reward_rank, 2, str(tmp_path), 2.0, 20.0)
    assert "error" not in r0 and "error" not in r1, (r0, r1)
    assert r0["rewards"] == r1["rewards"] == r0["lengths"]
    assert r1["waited"] > TRAINING_TIMEOUT_S


def test_rank0_stuck_past_the_rewards_bound_is_one_named_error_on_the_waiting_rank(tmp_path):
    # rank 1's bound: 0.5 (start) + 2 samples per worker x (0.5 timeout + 0.5 start) + 0.5 = 3 s
    _, r1 = run_distributed(_reward_rank, 2, str(tmp_path), 0.0, 0.5)
    assert r1["error"].startswith(
        "WaitTimeoutError: rank 1 waited more than 3 s (rollout.reward_timeout_s=0.5 for each of 2 "
        "samples per worker on rollout.reward_workers=2, 0.5 s per worker start, 0.5 s slack) "
        "for the rewards of 4 samples (rank 0 scores them)"
    ), r1
    assert 3.0 <= r1["waited"] < 5.5  # rank 0's stall is 6 s


class PidTool:
    """An environment whose answers depend on the process playing it: each step's observation
    is the last digit of its pid, the reward the pid; every call is a line in ``$PID_TOOL_LOG``
    (a side effect). Done at the second turn."""

    def __init__(self) -> None:
        self.turns = 0

    def reset(self, prompt, metadata) -> None:
        self.turns = 0

    def step(self, turn):
        with open(os.environ["PID_TOOL_LOG"], "a") as handle:
            handle.write(f"{os.getpid()}\n")
        self.turns += 1
        return "=" + str(os.getpid() % 10), float(os.getpid()), self.turns == 2


class BrokenTool(PidTool):
    """`PidTool` whose step raises (``$BROKEN_TOOL`` = raise) or hangs 2.5 s (= hang)."""

    def step(self, turn):
        if os.environ["BROKEN_TOOL"] == "raise":
            raise ValueError("the tool broke")
        time.sleep(2.5)  # past the 1-s env_step_timeout_s
        return super().step(turn)


def _episode_rank(rank: int, world: int, log: str, broken: str = "") -> dict:
    import torch

    from tests.tiny_models import tiny_llama
    from unirl.rollouts.data.tasks import make_task
    from unirl.rollouts.environments.episodes import EpisodeLimits
    from unirl.rollouts.sampler_source import SamplerRolloutSource

    torch.set_num_threads(1)
    os.environ["PID_TOOL_LOG"] = log
    os.environ["BROKEN_TOOL"] = broken
    task = make_task("tool_lookup")
    source = SamplerRolloutSource(
        task,
        tiny_llama(task.tokenizer.vocab_size),
        prompts_per_rollout=2,
        samples_per_prompt=2,
        temperature=1.0,
        top_p=1.0,
        max_new_tokens=3,
        seed=3,
        verify_sync=True,
        environment=BrokenTool if broken else PidTool,
        episode_limits=EpisodeLimits(max_turns=3, max_tokens=16, step_timeout_s=1.0),
        max_seq_len=24,
    )
    t0 = time.monotonic()
    try:
        batch = source.next_rollout(0)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "waited": time.monotonic() - t0}
    return {
        "pid": os.getpid(),
        "rewards": [s.reward for s in batch.samples],
        "tokens": [s.response_tokens.tolist() for s in batch.samples],
        "mask": [s.loss_mask.tolist() for s in batch.samples],
    }


def test_sampler_episodes_run_once_on_rank0_and_every_rank_holds_its_batch(tmp_path):
    log = tmp_path / "calls.txt"
    r0, r1 = run_distributed(_episode_rank, 2, str(log))
    callers = log.read_text().split()
    # 4 episodes of at most 2 environment steps each, every one played by rank 0
    assert 4 <= len(callers) <= 8 and set(callers) == {str(r0["pid"])}
    # an episode's reward is the sum of its turns' (each rank 0's pid): rank 0's, on both ranks
    assert r0["rewards"] == r1["rewards"]
    assert set(r0["rewards"]) <= {0.0, float(r0["pid"]), 2.0 * r0["pid"]} and any(r0["rewards"])
    assert r0["tokens"] == r1["tokens"] and r0["mask"] == r1["mask"]


@pytest.mark.parametrize(
    ("broken", "words"),
    [
        ("raise", "ValueError: the tool broke"),
        # the same path after rank 0's own timeout; the job-level case is in tests/faults
        pytest.param("hang", "env_step_timeout_s=1", marks=pytest.mark.slow),
    ],
)
def test_an_environment_that_fails_on_rank0_stops_both_ranks_with_its_error(
    tmp_path, broken, words
):
    """The episodes run on rank 0 only: its tool raising, or hanging past
    ``rollout.env_step_timeout_s``, is rank 0's error, and rank 1 raises the same one at once
    (it does not wait out a bound of its own for a rank that already failed)."""
    r0, r1 = run_distributed(_episode_rank, 2, str(tmp_path / "calls.txt"), broken)
    assert r0["error"] == r1["error"], (r0, r1)
    assert r1["error"].startswith("RolloutDataError: ") and words in r1["error"], r1
    assert r1["waited"] < 5.0  # the hang: 1 s, then the error travels
