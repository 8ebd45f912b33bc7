"""R3 from a file (`unirl.rollouts.routing_capture`): the experts captured on finished samples are
each MoE layer's top-k of a Hugging Face fp32 forward (written here from the router's weight and
the hidden states entering each sparse block), in the contract's shape and token order; a written
file validates against the model like any rollout file; and vLLM refuses R3 at config time with
the reason (its CPU build returns no routed experts)."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from tests.tiny_models import TINY_BATCH  # noqa: E402
from tests.unit.replay_fixtures import MOE_HF  # noqa: E402
from unirl.core.config.model_shape import moe_shape  # noqa: E402
from unirl.core.config.run_config import config_from_dict  # noqa: E402
from unirl.core.data.rollout import RolloutSample  # noqa: E402
from unirl.core.data.rollout_io import read_rollouts  # noqa: E402
from unirl.core.errors import ConfigError  # noqa: E402
from unirl.rollouts.routing_capture import capture_routed_experts, write_moe_rollouts  # noqa: E402


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(**{k: v for k, v in MOE_HF.items() if k != "model_type"})
    return transformers.Qwen3MoeForCausalLM(cfg).eval()


def _reference_topk(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """``[tokens, moe_layers, top_k]``: at every sparse block, ``topk(softmax(x W^T))`` of the
    hidden states ``x`` entering it (plain PyTorch on what transformers' layers compute)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    blocks = [m for m in model.modules() if isinstance(m, Qwen3MoeSparseMoeBlock)]
    inputs: dict[int, torch.Tensor] = {}
    handles = [
        b.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0].reshape(-1, a[0].shape[-1])))
        for i, b in enumerate(blocks)
    ]  # fmt: skip
    with torch.no_grad():
        model(input_ids=torch.tensor([tokens]))
    for h in handles:
        h.remove()
    k = MOE_HF["num_experts_per_tok"]
    per_layer = []
    for i, block in enumerate(blocks):
        weight = next(p for n, p in block.named_parameters() if n.startswith("gate"))
        probs = torch.softmax(inputs[i].double() @ weight.double().T, dim=-1)
        per_layer.append(probs.topk(k, dim=-1).indices)
    return torch.stack(per_layer, dim=1)


def test_captured_experts_are_each_layers_top_k_of_an_fp32_forward():
    model = _model()
    samples = [
        RolloutSample(prompt_tokens=[1, 5, 9], response_tokens=torch.tensor([4, 7, 2]), reward=1.0, group_id=0),
        RolloutSample(prompt_tokens=[3, 3], response_tokens=torch.tensor([30]), reward=0.0, group_id=0),
    ]  # fmt: skip
    out = list(capture_routed_experts(model, samples))
    for sample, got in zip(samples, out, strict=True):
        tokens = [*sample.prompt_tokens, *sample.response_tokens.tolist()]
        want = _reference_topk(model, tokens)[:-1]  # the last token is never read
        # 3 layers, the middle one dense: 2 MoE layers of top-2
        assert got.routed_experts.shape == (len(tokens) - 1, 2, 2)
        assert got.routed_experts.dtype == torch.int32
        assert torch.equal(got.routed_experts.sort(-1).values, want.sort(-1).values.int())
        assert got.reward == sample.reward and torch.equal(got.prompt_tokens, sample.prompt_tokens)


def _cfg(**rollout) -> dict:
    return {
        "backend": "deepspeed",
        "model": {"hf_config": {**MOE_HF, "vocab_size": 16}, "init_seed": 1, "max_seq_len": 32},
        "batch": dict(TINY_BATCH),
        "parallel": {"world_size": 1},
        "algorithm": {"routing_replay": "rollout"},
        # R3 replays an engine's experts: rollouts from a file (the sampler records none)
        "rollout": {"max_new_tokens": 8, "source": "file", "file": "r.jsonl", **rollout},
    }


def test_a_written_file_validates_against_the_model(tmp_path):
    pytest.importorskip("deepspeed")
    from unirl.rollouts.build import build_task
    from unirl.rollouts.model import build_task_model

    cfg = config_from_dict(_cfg())
    model = build_task_model(cfg.model, build_task(cfg).tokenizer)
    path = tmp_path / "r.jsonl"
    assert write_moe_rollouts(path, cfg, 1, seed=0, hf_model=model) == 4
    batch = read_rollouts(path)
    batch.validate(vocab_size=16, max_seq_len=32, samples_per_prompt=2, moe=moe_shape(cfg.model))
    for s in batch.samples:
        assert s.routed_experts.shape == (s.prompt_length + s.response_length - 1, 2, 2)


def test_vllm_refuses_rollout_replay_with_the_reason():
    pytest.importorskip("deepspeed")
    with pytest.raises(ConfigError, match=r"rollout\.source: vllm does not return them.*record"):
        config_from_dict(_cfg(source="vllm"))
