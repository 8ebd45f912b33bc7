"""``optimizer.offload``: the memory plan that decides it (`unirl.core.config.optimizer_offload`),
as a table against sizes worked out by hand, and the load-time refusals."""

from __future__ import annotations

import pytest

from unirl.core.config.optimizer_offload import choose_optimizer_offload, model_params
from unirl.core.config.run_config import config_from_dict
from unirl.core.errors import ConfigError

GIB = 2**30

# Qwen3-4B's config.json (the shape of benchmarks/megatron_throughput.py's qwen3-4b)
QWEN3_4B = {
    "model_type": "qwen3",
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}
# per layer: q and o 2 x 2560 x 4096 = 20,971,520; k and v 2 x 2560 x 1024 = 5,242,880;
# gate, up, down 3 x 2560 x 9728 = 74,711,040 -> 100,925,440 x 36 = 3,633,315,840
# + the tied embedding 151,936 x 2560 = 388,956,160
QWEN3_4B_PARAMS = 4_022_272_000


def _cfg(backend="megatron", world_size=1, **sections):
    data = {
        "backend": backend,
        "model": {"hf_config": dict(QWEN3_4B), "dtype": "bf16", "max_seq_len": 4096},
        "batch": {"max_tokens_per_microbatch": 4096},
        "parallel": {"zero_stage": 0 if backend == "fsdp2" else 1},
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    return config_from_dict(data, world_size=world_size)


def test_qwen3_4b_parameters_by_hand():
    assert model_params(QWEN3_4B) == QWEN3_4B_PARAMS
    untied = {**QWEN3_4B, "tie_word_embeddings": False}
    assert model_params(untied) == QWEN3_4B_PARAMS + 388_956_160
    assert model_params({"hidden_size": 8}) is None


@pytest.mark.parametrize(
    ("backend", "world", "sections", "offload", "resident_gib"),
    [
        # Megatron bf16, one H100: 2 + 4 + 4 + 8 = 18 bytes -> 67.4 GiB > 0.8 x 79.1 = 63.3
        ("megatron", 1, {"optimizer": {"offload_gpu_gib": 79.1}}, True, 18 * QWEN3_4B_PARAMS),
        # on an H200's 139 GiB (111.2 allowed) it stays
        ("megatron", 1, {"optimizer": {"offload_gpu_gib": 139.0}}, False, 18 * QWEN3_4B_PARAMS),
        # two data-parallel ranks, distributed optimizer: 2 + 4 + 12 / 2 = 12 bytes -> 45.0 GiB
        ("megatron", 2, {"optimizer": {"offload_gpu_gib": 79.1}}, False, 12 * QWEN3_4B_PARAMS),
        # FSDP2 one rank: 4 + 4 + 8 = 16 bytes -> 59.9 GiB, within 63.3
        ("fsdp2", 1, {"optimizer": {"offload_gpu_gib": 79.1}}, False, 16 * QWEN3_4B_PARAMS),
        # DeepSpeed ZeRO-1 one rank: 2 + 2 + 8 + 8 = 20 bytes -> 74.9 GiB
        ("deepspeed", 1, {"optimizer": {"offload_gpu_gib": 79.1}}, True, 20 * QWEN3_4B_PARAMS),
    ],
)
def test_auto_offloads_when_the_state_exceeds_the_share(
    backend, world, sections, offload, resident_gib
):
    choice = choose_optimizer_offload(_cfg(backend, world, **sections))
    assert choice.offload is offload
    assert f"optimizer state {resident_gib / GIB:.1f} GiB per GPU" in choice.reason
    assert ("offloaded:" in choice.reason) is offload


@pytest.mark.parametrize(
    ("sections", "offload", "says"),
    [
        ({"optimizer": {"offload": "none", "offload_gpu_gib": 10.0}}, False, "offload: none"),
        ({"optimizer": {"offload": "cpu", "offload_gpu_gib": 1000.0}}, True, "HybridDevice"),
        # no GPU visible (the CPU tests) and no planned one: nothing to offload from
        ({}, False, "no GPU visible"),
        ({"model": {"lora": {"rank": 4}}, "optimizer": {"offload_gpu_gib": 1.0}}, False, "LoRA"),
        # the distributed optimizer is what megatron offloads
        ({"parallel": {"zero_stage": 0}, "optimizer": {"offload_gpu_gib": 1.0}}, False, "zero"),
    ],
)
def test_forced_and_not_offloadable(sections, offload, says, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    choice = choose_optimizer_offload(_cfg(**sections))
    assert choice.offload is offload
    assert says.lower() in choice.reason.lower()


@pytest.mark.parametrize(
    ("backend", "sections", "match"),
    [
        ("megatron", {"parallel": {"zero_stage": 0}, "optimizer": {"offload": "cpu"}}, "zero_stage"),
        ("deepspeed", {"parallel": {"zero_stage": 0}, "optimizer": {"offload": "cpu"}}, "zero_stage"),
        ("megatron", {"critic": {"optimizer": {"offload": "cpu"}},
                      "algorithm": {"advantage_estimator": "gae"}}, "critic.optimizer.offload"),
        ("megatron", {"critic": {"optimizer": {"offload_state_fraction": 0.5}},
                      "algorithm": {"advantage_estimator": "gae"}},
         "critic.optimizer.offload_state_fraction"),
        ("megatron", {"model": {"lora": {"rank": 4}}, "optimizer": {"offload": "cpu"}}, "lora"),
        ("fsdp2", {"fsdp2": {"cpu_offload": True}, "optimizer": {"offload": "none"}}, "cpu_offload"),
    ],
)  # fmt: skip
def test_refused_at_load(backend, sections, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(backend, **sections)
