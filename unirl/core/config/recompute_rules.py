"""The rules of ``model.recompute_attention`` (what it reports: `unirl.core.config.recompute_plan`),
on the model section alone: the run config calls them while it is built, so they cannot read it.
The backends check again at build, against the model they load (a ``model.path`` folder may be
unreadable when the config is checked)."""

from __future__ import annotations

from typing import Any

from unirl.core.config.model_shape import hf_config_fields
from unirl.core.config.param_count import moe_keys
from unirl.core.config.sections.model import ModelConfig
from unirl.core.errors import ConfigError


def check_recompute_attention(m: ModelConfig) -> None:
    """``model.recompute_attention: false`` narrows whole-layer recompute of a dense model."""
    if m.recompute_attention:
        return
    if not m.gradient_checkpointing:
        raise ConfigError(
            "model.recompute_attention: false keeps attention's output in the layers "
            "model.gradient_checkpointing recomputes, which is off; set "
            "model.gradient_checkpointing: true or remove model.recompute_attention"
        )
    refuse_experts(hf_config_fields(m) or {})


def refuse_experts(hf: dict[str, Any]) -> None:
    """A mixture-of-experts config (``hf``: its Hugging Face fields) is refused: kept attention
    is built and measured for dense layers only."""
    keys = moe_keys(hf) or moe_keys(hf.get("text_config") or {})
    if keys:
        raise ConfigError(
            f"model.recompute_attention: false with a mixture-of-experts model ({keys}): kept "
            "attention is built for dense layers only; remove model.recompute_attention"
        )
