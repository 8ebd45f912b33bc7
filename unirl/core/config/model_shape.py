"""What core needs to know of a model's mixture-of-experts shape, read from its Hugging Face config
as plain data (``model.hf_config``, or ``config.json`` in ``model.path``), without transformers.

Routing replay (``algorithm.routing_replay``) needs it twice: at config load, to refuse replay on a
dense model; and on every rollout, to check each sample's ``routed_experts`` against the number of
MoE layers, the top-k and the expert count. A backend builds the model later, from the same
config, so the answer is the backend's model's: the probe applies the Hugging Face rule for which
layers are sparse, with Hugging Face's defaults for keys a hand-written config leaves out
(tests/unit/test_routing_replay_config.py checks both against the built transformers model).

Each MoE family registers how to read its config under its ``model_type`` (`MOE_SHAPES`); a
``model_type`` that is not registered is dense as far as core can tell.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from unirl.core.config.sections.model import ModelConfig
from unirl.core.data.routed_experts import MoeShape
from unirl.core.errors import ConfigError
from unirl.core.registry import Registry

__all__ = ["MOE_SHAPES", "MoeShape", "head_dim", "hf_config_fields", "moe_shape"]

# model_type -> reads a Hugging Face config dict into its `MoeShape`.
MoeReader = Callable[[Mapping[str, Any]], MoeShape]
MOE_SHAPES: Registry[MoeReader] = Registry(
    "mixture-of-experts model type", key="model.hf_config.model_type"
)


def head_dim(hf: Mapping[str, Any]) -> int:
    """One attention head's width: ``head_dim`` where the config sets it (Qwen3-4B: 128, not
    2,560 / 32), else ``hidden_size / num_attention_heads``, Hugging Face's default."""
    return int(hf.get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"]))


def _int(hf: Mapping[str, Any], key: str, default: int) -> int:
    value = hf.get(key, default)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"model.hf_config.{key}={value!r} must be an integer")
    return value


def _qwen3_moe(hf: Mapping[str, Any]) -> MoeShape:
    """Qwen3-MoE (transformers' `Qwen3MoeDecoderLayer`): layer i is sparse unless listed in
    ``mlp_only_layers``, when ``num_experts > 0`` and ``(i + 1) % decoder_sparse_step == 0``.
    Defaults are `Qwen3MoeConfig`'s (transformers 5.19)."""
    layers = _int(hf, "num_hidden_layers", 24)
    # transformers 5 writes num_experts to config.json as num_local_experts (its attribute_map)
    key = "num_experts" if hf.get("num_experts") is not None else "num_local_experts"
    experts = _int(hf, key, 128)
    top_k = _int(hf, "num_experts_per_tok", 8)
    step = _int(hf, "decoder_sparse_step", 1)
    if step < 1:
        raise ConfigError(f"model.hf_config.decoder_sparse_step={step} must be >= 1")
    if not 1 <= top_k <= max(experts, 1):
        raise ConfigError(
            f"model.hf_config.num_experts_per_tok={top_k} must be in [1, num_experts={experts}]"
        )
    dense = set(hf.get("mlp_only_layers") or ())
    sparse = tuple(
        i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0
    )
    return MoeShape(
        num_experts=experts,
        top_k=top_k,
        moe_layers=sparse,
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
    )


MOE_SHAPES.register("qwen3_moe", _qwen3_moe)


def hf_config_fields(model: ModelConfig) -> dict[str, Any] | None:
    """``model.hf_config``, else ``model.path``'s ``config.json`` as plain JSON; None when the
    folder has no readable config (the backend reports that when it builds the model)."""
    if model.hf_config is not None:
        return dict(model.hf_config)
    if model.path is None:
        return None
    path = Path(model.path).expanduser() / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def moe_shape(model: ModelConfig) -> MoeShape | None:
    """The model's `MoeShape`, or None for a dense model (a ``model_type`` no MoE reader is
    registered for, or one whose layers are all dense). Raises `ConfigError` when the config
    cannot be read: routing replay must not guess."""
    hf = hf_config_fields(model)
    if hf is None:
        where = f"{model.path}/config.json" if model.path else "model.hf_config"
        raise ConfigError(
            f"cannot read the model's Hugging Face config ({where}) to tell whether it is a "
            "mixture-of-experts model; give model.hf_config or a model.path folder with config.json"
        )
    reader = MOE_SHAPES.find(str(hf.get("model_type")))
    if reader is None:
        return None
    shape = reader(hf)
    return shape if shape.moe_layers else None
