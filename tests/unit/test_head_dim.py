"""`unirl.core.config.model_shape.head_dim` against the width transformers gives each head of
the model it builds from the same config: a set ``head_dim`` (Qwen3's, unlike hidden / heads) and
none (Llama's default)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from unirl.core.config.model_shape import head_dim

SHAPE = {
    "vocab_size": 32,
    "hidden_size": 48,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@pytest.mark.parametrize(
    "config",
    [Qwen3Config(**SHAPE, head_dim=16), LlamaConfig(**SHAPE)],
    ids=["qwen3-set", "llama-default"],
)
def test_head_dim_is_the_built_models_head_width(config):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    q = model.model.layers[0].self_attn.q_proj
    width = q.out_features // config.num_attention_heads
    assert head_dim(config.to_dict()) == width
    assert head_dim({k: v for k, v in SHAPE.items()}) == 48 // 4  # no key: hidden / heads
