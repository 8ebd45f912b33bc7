"""Training clients: one `TrainingBackend` each (its own weights and optimizer state), built
from the server's ``train`` config with ``model.path`` set to the base model's folder.

Separate backends keep clients apart by construction: interleaved requests of two clients
touch two models and two optimizers, never one. The Tinker API trains a LoRA adapter; until
unirl's backends train adapters (``model.lora``), a client trains its whole model (full
fine-tuning) and `GetInfo` says so (``is_lora: false``).
"""

from __future__ import annotations

from pathlib import Path

import attrs

from unirl.backends import build_backend
from unirl.core.backend import TakesStepSettings, TrainingBackend
from unirl.core.config.run_config import config_from_dict
from unirl.core.errors import ConfigError
from unirl.serve.config import ServeConfig
from unirl.serve.errors import BadRequest


@attrs.define(eq=False)
class TrainingSession:
    model_id: str
    base_model: str
    backend: TrainingBackend
    optimizer_steps: int = 0


def base_model_folder(cfg: ServeConfig, base_model: str, field: str = "base_model") -> Path:
    if base_model not in cfg.base_models:
        raise BadRequest(
            field,
            f"is {base_model!r}, which this server does not serve; it serves "
            f"{sorted(cfg.base_models)} (serve.base_models)",
        )
    return cfg.base_model_folder(base_model)


def build_training_backend(cfg: ServeConfig, weights: Path) -> TrainingBackend:
    """A backend on the Hugging Face folder ``weights`` (a base model, or a saved state's
    weights) with the ``train`` config's engine, layout and optimizer."""
    data = dict(cfg.train)
    data["model"] = {**dict(data.get("model") or {}), "path": str(weights)}
    run_cfg = config_from_dict(data)
    backend = build_backend(run_cfg, total_optimizer_steps=1)
    if not isinstance(backend, TakesStepSettings):
        backend.close()
        raise ConfigError(
            f"serve.train.backend={run_cfg.backend!r} cannot take the SDK's per-step Adam "
            "settings (TakesStepSettings); use backend: fsdp2"
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
        return self._by_id[model_id]

    def __contains__(self, model_id: str) -> bool:
        return model_id in self._by_id

    def close(self) -> None:
        for session in self._by_id.values():
            session.backend.close()
        self._by_id.clear()
