"""Training clients: one `TrainingBackend` each (its own weights and optimizer state), built
from the server's ``train`` config with ``model.path`` set to the base model's folder.

Separate backends keep clients apart by construction: interleaved requests of two clients
touch two models and two optimizers, never one. Each client trains a LoRA adapter (``model.lora``,
through peft on the Hugging Face engines) on the frozen base weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from unirl.backends import build_backend
from unirl.core.backend import TakesStepSettings, TrainingBackend
from unirl.core.config.run_config import UnirlConfig, config_from_dict
from unirl.core.errors import ConfigError
from unirl.serve.config import ServeConfig
from unirl.serve.errors import BadRequest


@attrs.define(eq=False)
class TrainingSession:
    model_id: str
    base_model: str
    backend: TrainingBackend
    lora: Mapping[str, Any]  # the client's model.lora section
    optimizer_steps: int = 0
    # Set when a forward_backward / optim_step of this client failed inside the backend: its
    # gradients or weights may be partial, so it takes no more requests.
    failed: str | None = None


def base_model_folder(cfg: ServeConfig, base_model: str, field: str = "base_model") -> Path:
    if base_model not in cfg.base_models:
        raise BadRequest(
            field,
            f"is {base_model!r}, which this server does not serve; it serves "
            f"{sorted(cfg.base_models)} (serve.base_models)",
        )
    return cfg.base_model_folder(base_model)


_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def lora_section(cfg: ServeConfig, body: Mapping[str, Any]) -> dict[str, Any]:
    """``model.lora`` for the SDK's ``lora_config`` (rank, seed, which layers): its targets
    are the attention and / or MLP linears and the LM head (``train_unembed``); alpha, dropout
    come from ``serve.train.model.lora`` (unirl's defaults otherwise)."""
    lora = body.get("lora_config")
    if not isinstance(lora, Mapping):
        raise BadRequest("lora_config", "is missing; the Tinker API trains LoRA adapters")
    rank = lora.get("rank")
    if not isinstance(rank, int) or rank < 1:
        raise BadRequest("lora_config.rank", f"is {rank!r}; a positive integer")
    if rank > cfg.max_lora_rank:
        raise BadRequest(
            "lora_config.rank",
            f"is {rank}, over this server's serve.max_lora_rank={cfg.max_lora_rank}",
        )
    targets = [
        *(_ATTN if lora.get("train_attn", True) else ()),
        *(_MLP if lora.get("train_mlp", True) else ()),
        *(("lm_head",) if lora.get("train_unembed", True) else ()),
    ]
    if not targets:
        raise BadRequest(
            "lora_config", "trains nothing: set train_attn, train_mlp or train_unembed"
        )
    template = dict(dict(cfg.train.get("model") or {}).get("lora") or {})
    seed = lora.get("seed")
    return {**template, "rank": rank, "target_modules": targets, "init_seed": seed or 0}


def train_config(cfg: ServeConfig, weights: Path, lora: Mapping[str, Any]) -> UnirlConfig:
    """The unirl config of a client's backend: ``serve.train`` with the adapter ``lora`` (a
    ``model.lora`` section) on the Hugging Face folder ``weights``."""
    data = dict(cfg.train)
    data["model"] = {**dict(data.get("model") or {}), "path": str(weights), "lora": dict(lora)}
    # the engine's own token budget, set from the one the server packs to (only the serve key)
    data["batch"] = {"max_tokens_per_microbatch": cfg.tokens_per_microbatch}
    return config_from_dict(data)


def build_training_backend(
    cfg: ServeConfig, weights: Path, lora: Mapping[str, Any]
) -> TrainingBackend:
    """A backend with `train_config`'s engine, layout, optimizer and adapter. An adapter the
    backend cannot train (Megatron: an LM head tied to the embeddings, ``train_unembed``) is
    the client's 400."""
    try:
        run_cfg = train_config(cfg, weights, lora)
        backend = build_backend(run_cfg, total_optimizer_steps=1)
    except ConfigError as exc:
        if "model.lora" not in str(exc):
            raise
        raise BadRequest(
            "lora_config",
            f"asks for an adapter serve.train.backend={cfg.train.get('backend')!r} cannot train "
            f"({exc}); ask for fewer layers (train_unembed / train_attn / train_mlp)",
        ) from exc
    if not isinstance(backend, TakesStepSettings):
        backend.close()
        raise ConfigError(
            f"serve.train.backend={run_cfg.backend!r} cannot take the SDK's per-step Adam "
            "settings (TakesStepSettings); use backend: fsdp2, deepspeed or megatron"
        )
    return backend


class Sessions:
    """The server's training clients by model id (``<session>:train:<n>``, the SDK's own
    spelling, which it also derives itself for create-from-state)."""

    def __init__(self) -> None:
        self._by_id: dict[str, TrainingSession] = {}

    def add(self, session: TrainingSession) -> None:
        self._by_id[session.model_id] = session

    def get(self, model_id: str, field: str = "model_id") -> TrainingSession:
        if model_id not in self._by_id:
            raise BadRequest(field, f"is {model_id!r}, which is not a training client here")
        session = self._by_id[model_id]
        if session.failed is not None:
            raise BadRequest(
                field,
                f"{model_id!r} stopped at a server error ({session.failed}); its gradients or "
                "weights may be partial: create a client from its last saved state "
                "(create_training_client_from_state_with_optimizer)",
            )
        return session

    def mark_failed(self, model_id: str, reason: str) -> None:
        if model_id in self._by_id:
            self._by_id[model_id].failed = reason

    def __contains__(self, model_id: str) -> bool:
        return model_id in self._by_id

    def close(self) -> None:
        for session in self._by_id.values():
            session.backend.close()
        self._by_id.clear()
