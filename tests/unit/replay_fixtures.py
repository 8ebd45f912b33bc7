"""Shared bits of the routing-replay tests: a tiny Qwen3-MoE config and a backend plug-in that
declares routing replay (no built-in backend does until the backends are wired to the hook)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import attrs

from unirl.core.protocols.backend_plugin import BACKENDS

REPLAY_BACKEND = "replay_test"
# 3 layers, the middle one dense (mlp_only_layers), 6 experts, top-2.
MOE_HF = {
    "model_type": "qwen3_moe",
    "vocab_size": 32,
    "hidden_size": 16,
    "intermediate_size": 24,
    "moe_intermediate_size": 8,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "num_experts": 6,
    "num_experts_per_tok": 2,
    "mlp_only_layers": [1],
    "norm_topk_prob": True,
}


@contextlib.contextmanager
def replay_backend() -> Iterator[str]:
    """The DeepSpeed plug-in under another name, declaring routing replay, for this scope."""
    with BACKENDS.scoped():
        plugin = attrs.evolve(
            BACKENDS.get("deepspeed"), name=REPLAY_BACKEND, supports_routing_replay=True
        )
        BACKENDS.register(REPLAY_BACKEND, plugin)
        yield REPLAY_BACKEND
