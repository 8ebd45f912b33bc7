"""``model.lora``: train a low-rank adapter on the frozen policy instead of all its weights (Hu et
al. 2021, arXiv:2106.09685), the same key on every backend.

What each backend adapts: DeepSpeed and FSDP2 through the ``peft`` library; Megatron through its
own adapters on megatron-core's column- and row-parallel linears (`unirl.backends.megatron.lora`).
The targets are Hugging Face module names on every backend (Megatron maps them onto its fused
layers: q/k/v onto ``linear_qkv``, gate/up onto ``linear_fc1``, each with its own adapter), so one
config and one exported PEFT folder mean the same on all three. Under LoRA the reference model is
the policy with its adapter off (no second copy of the weights), the optimizer holds only the
adapter, and the rollout engine receives only the adapter at each sync."""

from __future__ import annotations

import attrs

from unirl.core.config.validators import finite, in_range, positive
from unirl.core.errors import ConfigError

# Every linear of a Llama / Qwen-style decoder layer (PEFT's "all-linear" for these models,
# the LM head excluded).
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _targets(instance: object, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
    if not value:
        raise ConfigError(
            "model.lora.target_modules is empty; name the linears to adapt, e.g. "
            f"{list(ALL_LINEAR)}"
        )
    bad = [name for name in value if not name or "." in name or not name.isidentifier()]
    if bad:
        raise ConfigError(
            f"model.lora.target_modules: {bad} are not module names; give the last part of a "
            "Hugging Face module's name (e.g. q_proj, down_proj)"
        )
    if len(set(value)) != len(value):
        raise ConfigError(f"model.lora.target_modules names a module twice: {list(value)}")


@attrs.frozen(kw_only=True)
class LoraConfig:
    """The adapter: ``rank`` and ``alpha`` (the update is ``alpha / rank * B @ A``), dropout on
    the adapter's input, the targeted linears, and optionally a PEFT adapter folder to start
    from (else A is random, B zero: the first policy equals the base model)."""

    rank: int = attrs.field(default=16, validator=positive)
    alpha: float = attrs.field(default=32.0, validator=[finite, positive])
    dropout: float = attrs.field(
        default=0.0, validator=in_range(0, 1, high_open=True, why="a dropout probability")
    )
    target_modules: tuple[str, ...] = attrs.field(
        default=ALL_LINEAR, converter=tuple, validator=_targets
    )
    # Mixture-of-experts models: adapt the routed experts' targeted projections too (each expert
    # its own adapter); off: only attention and dense MLPs are adapted.
    target_experts: bool = False
    # A PEFT adapter folder (adapter_config.json + adapter_model.safetensors) to start from; its
    # rank, alpha and targets must match this section's.
    path: str | None = None
    # Seed of A's random initialisation (B starts at zero), the same on every rank and backend.
    init_seed: int = 0

    @property
    def scale(self) -> float:
        """The factor on ``B @ A``."""
        return self.alpha / self.rank
