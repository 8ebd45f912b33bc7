"""The DAPO data side through the CLI (`unirl train`, the built-in sampler, DeepSpeed on the CPU):
dynamic sampling on a prompt mix where most groups are uniform, with the truncation mask on,
synchronous and generated one rollout ahead (k = 1, with the overlong penalty too), each cut
mid-run and resumed equal to the uninterrupted run."""

from __future__ import annotations

import pytest

from tests.unit.test_train import EXAMPLES, assert_same_export, run_full_and_resumed

pytest.importorskip("deepspeed", reason="needs deepspeed (pip install unirl[deepspeed])")
pytest.importorskip("transformers", reason="needs transformers (pip install unirl[hf])")

DAPO = [str(EXAMPLES / "tiny_grpo.yaml"), "--set", "logging.tensorboard=false",
        "--set", "batch.prompts_per_rollout=4", "--set", "batch.samples_per_optimizer_step=32",
        "--set", "rollout.task=benchmarks.dynamic_sampling:mixed_task", "--set", "rollout.task_options={}",
        "--set", "rollout.dynamic_sampling.enabled=true",
        "--set", "rollout.dynamic_sampling.max_draws=12",
        "--set", "algorithm.mask_truncated=true"]  # fmt: skip
# the penalty varies with the response length, so it makes groups varied: the k = 1 case has it
OVERLONG = ["--set", "rollout.overlong.buffer_tokens=2"]
SAME = ("reward/mean", "loss", "grad_norm", "entropy")


def _check_rows(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        for key in SAME:
            assert ra[key] == rb[key], (ra["step"], key, ra[key], rb[key])


# Slow tier (20 s; CI time): CI keeps the one-rollout-ahead resume below, the same fix's harder case
@pytest.mark.slow
def test_dynamic_sampling_with_the_sampler_resumes_exactly(tmp_path):
    a, b = run_full_and_resumed(DAPO, tmp_path)
    _check_rows(a, b)
    # three quarters of the prompts are uniform: more than one draw per rollout, and each row
    # says so; a resumed run draws what the uninterrupted one drew
    assert sum(r["rollout/draws"] for r in a) > 4
    assert [r["rollout/draws"] for r in a] == [r["rollout/draws"] for r in b]
    assert all(
        0 < r["rollout/discarded_generation_fraction"] < 1 for r in a if r["rollout/draws"] > 1
    )
    assert all("rollout/truncated_masked_fraction" in r for r in a)
    assert_same_export(tmp_path, "hf")


def test_dynamic_sampling_generated_one_rollout_ahead_resumes_exactly(tmp_path):
    a, b = run_full_and_resumed([*DAPO, *OVERLONG, "--set", "train.max_staleness=1"], tmp_path)
    _check_rows(a, b)
    assert [r["reward/overlong_penalty"] for r in a] == [r["reward/overlong_penalty"] for r in b]
    assert all(r["reward/overlong_penalty"] <= 0 for r in a)
    # the worker's draws reach the trainer's log with the rollout they made; versions as k = 1
    assert all(r["rollout/draws"] >= 1 for r in a)
    assert [r["rollout/policy_version"] for r in a] == [0, 0, 1, 2]
    assert [r["rollout/staleness_max"] for r in a] == [0, 1, 1, 1]
    assert_same_export(tmp_path, "hf")
