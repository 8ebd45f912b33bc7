"""The tiny models, shapes and batches that tests in several files share, written once: two tests
that mean the same tiny model build it from one source (a test that needs another shape states
only what differs). Nothing here is a reference: the references stay in the tests."""

from __future__ import annotations

from typing import Any

import torch

# The tiny Llama of the sampler, the rollout sources and the Hugging Face backends' tests:
# 4 heads of 8 with grouped-query attention (2 KV heads). ``vocab_size`` is each test's.
TINY_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}

# A smaller one for the Hugging Face model and fused-head tests (2 heads of 8, 1 KV head).
MICRO_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 40,
    "max_position_embeddings": 32,
}

# The Megatron model tests' transformer (4 heads of 16, 2 KV heads); layers and vocabulary are
# each test's.
MEGATRON_DIMS: dict[str, Any] = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "rms_norm_eps": 1e-6,
}

# The smallest batch section that trains: 2 prompts x 2 samples, one optimizer step of 4 in two
# microbatches of 2.
TINY_BATCH: dict[str, int] = {
    "prompts_per_rollout": 2,
    "samples_per_prompt": 2,
    "samples_per_optimizer_step": 4,
    "micro_batch_size": 2,
}


def tiny_llama(vocab: int, seed: int = 0, *, tie: bool = False) -> torch.nn.Module:
    """The `TINY_LLAMA` model with ``vocab`` tokens, transformers' init under ``seed``, in eval
    mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**TINY_LLAMA, vocab_size=vocab, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def noisy_hf_model(config: Any, seed: int) -> torch.nn.Module:
    """A transformers fp32 model (eager attention, eval mode) whose every parameter is drawn at
    random from ``seed``: norms near 1, matrices (and stacked experts) at 0.2 and vectors at 0.1
    times a normal draw, larger than transformers' init so that a wrong layout shows clearly."""
    import transformers

    gen = torch.Generator().manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else (0.2 if p.ndim >= 2 else 0.1) * noise)
    return model
