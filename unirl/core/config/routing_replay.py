"""The rules of ``algorithm.routing_replay`` over the whole config, checked once at load.

Routing replay pins the experts a mixture-of-experts model routes each token to, so that the
trainer's forwards compute the log-probs of the same sparse model the rollout engine (R3,
``rollout``) or the old-log-prob forward (R2, ``record``) used:

- it needs a mixture-of-experts model (`unirl.core.config.model_shape`);
- ``record`` records in the old-log-prob forward, so the forward-only pass must run: `auto`
  recomputes (the registered need ``routing_replay`` in `unirl.core.old_logprobs`), ``reuse`` is
  refused there, and ``old_logprobs: rollout`` (which skips that pass) is refused here;
- the chosen backend must replay (its plug-in's ``supports_routing_replay``).
"""

from __future__ import annotations

from typing import Protocol

from unirl.core.config.model_shape import MoeShape, hf_config_fields, moe_shape
from unirl.core.config.sections.model import ModelConfig
from unirl.core.errors import ConfigError
from unirl.core.protocols.backend_plugin import BACKENDS
from unirl.core.protocols.config_view import RunConfigView


class ReplayConfig(RunConfigView, Protocol):
    """The run config as these rules read it: `UnirlConfig`, which calls `check_routing_replay`
    while it is built and so cannot be imported here (`unirl.core.protocols.config_view`)."""

    @property
    def model(self) -> ModelConfig: ...


def replay_shape(cfg: ReplayConfig) -> MoeShape | None:
    """The MoE shape that rollouts' ``routed_experts`` are checked against: None when routing
    replay is off (the field is then not needed, and checked only if a sample gives it)."""
    if cfg.algorithm.routing_replay == "off":
        return None
    shape = moe_shape(cfg.model)
    assert shape is not None, "check_routing_replay refuses replay on a dense model"
    return shape


def check_routing_replay(cfg: ReplayConfig) -> None:
    mode = cfg.algorithm.routing_replay
    if mode == "off":
        return
    key = f"algorithm.routing_replay={mode!r}"
    if moe_shape(cfg.model) is None:
        model_type = (hf_config_fields(cfg.model) or {}).get("model_type")
        raise ConfigError(
            f"{key} needs a mixture-of-experts model (model_type qwen3_moe with sparse layers), "
            f"but model_type={model_type!r} has no MoE layer: there is no routing to replay; set "
            "algorithm.routing_replay: off"
        )
    if mode == "record" and cfg.old_logprobs == "rollout":
        raise ConfigError(
            f"{key} records each token's experts in the old-log-prob forward, which "
            "old_logprobs: rollout skips; use old_logprobs: auto (or recompute), or "
            "algorithm.routing_replay: rollout to replay the rollout engine's experts"
        )
    plugin = BACKENDS.get(cfg.backend)
    if not plugin.supports_routing_replay:
        raise ConfigError(
            f"{key}: backend: {cfg.backend} does not replay MoE routing yet; set "
            "algorithm.routing_replay: off or use a backend that replays"
        )
