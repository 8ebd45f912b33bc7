"""``optimizer.offload``: the memory plan that decides it (`unirl.core.config.optimizer_offload`),
as a table against sizes worked out by hand, and the load-time refusals."""

from __future__ import annotations

import pytest

from unirl.core.config.optimizer_offload import choose_optimizer_offload
from unirl.core.config.param_count import ParamCount, model_params, param_count
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


# Qwen3-30B-A3B's config.json: 48 layers, all sparse, 128 experts of width 768, untied
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
# per layer: q and o 2 x 2048 x 4096 = 16,777,216; k and v 2 x 2048 x 512 = 2,097,152; the
# router 2048 x 128 = 262,144 -> 19,136,512 x 48 = 918,552,576; + the untied embeddings
# 2 x 151,936 x 2048 = 622,329,856 -> dense 1,540,882,432
# experts: 128 x 3 x 2048 x 768 = 603,979,776 per layer x 48 = 28,991,029,248 (30.53B in all)
QWEN3_30B_DENSE, QWEN3_30B_EXPERT = 1_540_882_432, 28_991_029_248
# Mixtral-8x7B: 8 experts of width 14336 in each of 32 layers, untied, 32000 tokens
MIXTRAL_8X7B = {
    "model_type": "mixtral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
# per layer: q, o 2 x 4096 x 4096 = 33,554,432; k, v 2 x 4096 x 1024 = 8,388,608; the router
# 4096 x 8 = 32,768 -> 41,975,808 x 32 = 1,343,225,856 + embeddings 2 x 32000 x 4096 =
# 262,144,000 -> dense 1,605,369,856; experts 8 x 3 x 4096 x 14336 x 32 = 45,097,156,608
# (46.70B in all, Mixtral's published size)
MIXTRAL_DENSE, MIXTRAL_EXPERT = 1_605_369_856, 45_097_156_608


def _cfg(backend="megatron", world_size=1, hf=QWEN3_4B, **sections):
    data = {
        "backend": backend,
        "model": {"hf_config": dict(hf), "dtype": "bf16", "max_seq_len": 4096},
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


def test_moe_parameters_by_hand():
    assert param_count(QWEN3_30B_A3B) == ParamCount(QWEN3_30B_DENSE, QWEN3_30B_EXPERT)
    assert param_count(MIXTRAL_8X7B) == ParamCount(MIXTRAL_DENSE, MIXTRAL_EXPERT)
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts
    renamed = {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"}
    assert param_count({**renamed, "num_local_experts": 128}) == param_count(QWEN3_30B_A3B)
    # layer 0 dense (mlp_only_layers): 128 experts and the router out, a 2048 x 6144 x 3 MLP in
    dense0 = param_count({**QWEN3_30B_A3B, "mlp_only_layers": [0]})
    assert dense0 == ParamCount(
        QWEN3_30B_DENSE - 262_144 + 3 * 2048 * 6144, QWEN3_30B_EXPERT - 603_979_776
    )


@pytest.mark.parametrize(
    "hf",
    [
        # DeepSeek-V3's routed and shared experts
        {**QWEN3_4B, "model_type": "deepseek_v3", "n_routed_experts": 256, "n_shared_experts": 1,
         "moe_intermediate_size": 2048},
        # Qwen2-MoE: a shared expert beside the routed ones
        {**QWEN3_30B_A3B, "model_type": "qwen2_moe", "shared_expert_intermediate_size": 5632},
        # experts under a model_type not counted
        {**QWEN3_4B, "num_experts": 64, "moe_intermediate_size": 512},
    ],
)  # fmt: skip
def test_unknown_moe_families_are_not_guessed(hf):
    assert param_count(hf) is None
    choice = choose_optimizer_offload(_cfg(hf=hf, optimizer={"offload_gpu_gib": 1.0}))
    assert not choice.offload
    assert "size is unknown (a mixture-of-experts config" in choice.reason


@pytest.mark.parametrize(
    ("parallel", "gib", "offload", "resident"),
    [
        # ep 8 over 8 ranks: dp 8, expert dp 8 / (1 x 8) = 1; dense 1.54B x (2 + 4 + 12 / 8 =
        # 7.5) + experts 28.99B / 8 x (2 + 4 + 12) = 71.5 GiB: within an H200's 111.2
        # (counting the experts like dense weights, over tp x pp only: 213.3 GiB, offloaded)
        ({"ep": 8}, 139.0, False, QWEN3_30B_DENSE * 7.5 + QWEN3_30B_EXPERT / 8 * 18),
        # ... and above an H100's 63.3
        ({"ep": 8}, 79.1, True, QWEN3_30B_DENSE * 7.5 + QWEN3_30B_EXPERT / 8 * 18),
        # tp 2, ep 4, etp 1: dense over tp 2 at 2 + 4 + 12 / 4 = 9 bytes; experts over ep x etp
        # = 4, over expert dp 8 / 4 = 2 at 2 + 4 + 12 / 2 = 12 bytes: 87.5 GiB
        ({"tp": 2, "ep": 4, "etp": 1, "sequence_parallel": True}, 139.0, False,
         QWEN3_30B_DENSE / 2 * 9 + QWEN3_30B_EXPERT / 4 * 12),
    ],
)  # fmt: skip
def test_auto_divides_the_experts_over_expert_parallel(parallel, gib, offload, resident):
    cfg = _cfg(
        world_size=8,
        hf=QWEN3_30B_A3B,
        parallel=parallel,
        optimizer={"offload_gpu_gib": gib},
    )
    choice = choose_optimizer_offload(cfg)
    assert choice.offload is offload
    assert f"optimizer state {resident / GIB:.1f} GiB per GPU" in choice.reason


def test_fsdp2_cpu_offload_decides_auto():
    """fsdp2.cpu_offload: true runs CPUOffloadPolicy whatever the plan: auto says offloaded,
    even on a GPU the state would fit (and under LoRA, whose adapter it offloads too)."""
    for lora in (None, {"rank": 4}):
        cfg = _cfg(
            "fsdp2",
            fsdp2={"cpu_offload": True},
            model={"lora": lora},
            optimizer={"offload_gpu_gib": 1000.0},
        )
        choice = choose_optimizer_offload(cfg)
        assert choice.offload
        assert "optimizer.offload: auto, fsdp2.cpu_offload: true: offloaded" in choice.reason
    plain = choose_optimizer_offload(_cfg("fsdp2", optimizer={"offload_gpu_gib": 1000.0}))
    assert not plain.offload


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
        ({"optimizer": {"offload": "none"}}, False, "offload: none"),
        ({"optimizer": {"offload": "cpu"}}, True, "HybridDevice"),
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
        # none and auto would be the same for the critic: a key that changes nothing
        ("megatron", {"critic": {"optimizer": {"offload": "none"}},
                      "algorithm": {"advantage_estimator": "gae"}},
         r"critic.optimizer.offload='none'.*remove critic.optimizer.offload"),
        # auto's planning keys under cpu / none
        ("megatron", {"optimizer": {"offload": "none", "offload_gpu_gib": 10.0}},
         r"optimizer.offload_gpu_gib=10.0 .* optimizer.offload is 'none'.*offload: auto"),
        ("megatron", {"optimizer": {"offload": "cpu", "offload_state_fraction": 0.5}},
         r"optimizer.offload_state_fraction=0.5 .* optimizer.offload is 'cpu'"),
        ("megatron", {"model": {"lora": {"rank": 4}}, "optimizer": {"offload": "cpu"}}, "lora"),
        ("fsdp2", {"fsdp2": {"cpu_offload": True}, "optimizer": {"offload": "none"}}, "cpu_offload"),
    ],
)  # fmt: skip
def test_refused_at_load(backend, sections, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(backend, **sections)
