"""A decoder's parameters counted from its Hugging Face config, split into the dense part and the
routed experts, for the memory plan of ``optimizer.offload: auto``
(`unirl.core.config.optimizer_offload`).

The split matters because expert parallelism places them differently: the dense weights are
divided over ``parallel.tp x parallel.pp``, the routed experts over ``parallel.ep x parallel.etp
x parallel.pp``, and megatron shards each part's optimizer state over its own data-parallel
ranks. Counted: the matmul weights (attention, MLPs, each MoE layer's router) and the
embeddings; norms and biases (under 0.1%) are left out.

A mixture-of-experts config is counted only for the families written here (`_MOE_COUNTERS`,
by ``model_type``); any other config that names experts (DeepSeek's ``n_routed_experts``,
Qwen2-MoE's shared expert, ...) is not guessed at: its size is unknown, so ``auto`` keeps the
state on the GPU and says why (an expert layout counted as dense would be off by the number of
experts, a shared expert left out by its width).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from unirl.core.config.model_shape import MOE_SHAPES, head_dim
from unirl.core.errors import ConfigError


@attrs.frozen
class ParamCount:
    """Parameters of the whole model: ``dense`` (attention, dense MLPs, routers, embeddings) and
    ``expert`` (the routed experts' weights)."""

    dense: int
    expert: int = 0

    @property
    def total(self) -> int:
        return self.dense + self.expert


def _attention(hf: Mapping[str, Any]) -> int:
    """q and o, k and v of one layer (grouped-query: ``num_key_value_heads``)."""
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    d = head_dim(hf)
    return 2 * h * heads * d + 2 * h * kv_heads * d


def _qwen3_moe(hf: Mapping[str, Any]) -> tuple[int, int]:
    """(dense MLP + router, expert) weights of all layers of a Qwen3-MoE: the sparse layers
    (``decoder_sparse_step``, ``mlp_only_layers``: `model_shape`'s rule) hold ``num_experts``
    experts of width ``moe_intermediate_size`` and a router, the others a dense MLP of
    ``intermediate_size``. No shared expert."""
    h, layers = hf["hidden_size"], hf["num_hidden_layers"]
    shape = MOE_SHAPES.get("qwen3_moe")(hf)
    sparse = len(shape.moe_layers)
    dense_mlp = 3 * h * hf["intermediate_size"] if sparse < layers else 0
    expert = sparse * shape.num_experts * 3 * h * hf["moe_intermediate_size"]
    return (layers - sparse) * dense_mlp + sparse * h * shape.num_experts, expert


def _mixtral(hf: Mapping[str, Any]) -> tuple[int, int]:
    """Mixtral: every layer sparse, ``num_local_experts`` experts of width
    ``intermediate_size`` and a router."""
    h, layers, experts = hf["hidden_size"], hf["num_hidden_layers"], hf["num_local_experts"]
    return layers * h * experts, layers * experts * 3 * h * hf["intermediate_size"]


# model_type -> (dense MLP + routers, experts) of all layers
_MOE_COUNTERS: dict[str, Callable[[Mapping[str, Any]], tuple[int, int]]] = {
    "qwen3_moe": _qwen3_moe,
    "mixtral": _mixtral,
}


def moe_keys(hf: Mapping[str, Any]) -> list[str]:
    """The keys of a config that name experts or MoE layers with a value set: the sign of a
    mixture-of-experts model."""
    return sorted(
        k for k, v in hf.items() if ("expert" in k or "moe" in k) and v not in (None, 0, [], False)
    )


def counted_moe_types() -> list[str]:
    """The ``model_type``s whose experts `param_count` counts."""
    return sorted(_MOE_COUNTERS)


def param_count(hf: Mapping[str, Any]) -> ParamCount | None:
    """The model's `ParamCount`; None when the config lacks a size this needs or is a
    mixture-of-experts family not counted here (module docstring)."""
    counter = _MOE_COUNTERS.get(str(hf.get("model_type")))
    if counter is None and moe_keys(hf):
        return None
    try:
        h, layers, vocab = hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"]
        attention = _attention(hf)
        if counter is not None:
            mlp, expert = counter(hf)
        else:
            mlp, expert = layers * 3 * h * hf["intermediate_size"], 0
    except (KeyError, TypeError, ZeroDivisionError, ConfigError):
        return None
    embeddings = vocab * h * (1 if hf.get("tie_word_embeddings") else 2)
    return ParamCount(dense=int(layers * attention + mlp + embeddings), expert=int(expert))


def model_params(hf: Mapping[str, Any]) -> int | None:
    """All of `param_count`'s parameters, or None."""
    count = param_count(hf)
    return None if count is None else count.total
