"""The built-in sampler under ``model.lora``: its model keeps the base weights and carries peft's
LoRA layers (``peft.inject_adapter_in_model``, the model's class unchanged), whose A and B are
overwritten at each adapter sync (`unirl.core.weights.adapter`).

Why peft's layers and not merged weights: a LoRA layer computes ``base(x) + scale * B(A(x))``,
as peft's layers on the Hugging Face backends do, so the sampler's log-probs are the trainer's
computation. Merging ``W + scale * B @ A`` into a copy rounds the update into every weight (an
fp32 rounding per element; far more in bf16), costs a second copy of the targeted weights, and
would leave the base weights changed: with the adapter kept apart they never change, which
`base_fingerprint` lets the verified sync prove.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from unirl.backends.peft_experts import expert_target_parameters
from unirl.backends.peft_folder import PEFT_PREFIX, peft_lora_config
from unirl.core.config.sections.lora import LoraConfig
from unirl.core.errors import ConfigError
from unirl.core.weights.adapter import scaled_for_fingerprint
from unirl.core.weights.fingerprint import Fingerprint

ADAPTER = "default"  # peft's name of the one adapter it injects


def _held_name(peft_name: str) -> str:
    """The sampler model's parameter of an adapter tensor in PEFT's names
    (``base_model.model.<module>.lora_A.weight`` -> ``<module>.lora_A.default.weight``)."""
    name = peft_name.removeprefix(PEFT_PREFIX)
    for part in ("lora_A", "lora_B"):
        name = name.replace(f".{part}.weight", f".{part}.{ADAPTER}.weight")
    return name


def _peft_name(held: str) -> str:
    return PEFT_PREFIX + held.replace(f".{ADAPTER}.weight", ".weight")


class SamplerAdapter:
    """``model`` (the sampler's own copy, changed in place) with ``lora``'s LoRA layers."""

    def __init__(self, model: torch.nn.Module, lora: LoraConfig) -> None:
        import peft

        experts = expert_target_parameters(model, lora)  # fused MoE experts (target_experts)
        config = peft_lora_config(lora, target_parameters=experts)
        self.model = peft.inject_adapter_in_model(config, model)
        self.model.requires_grad_(False)
        self.tensors = {
            name: p for name, p in self.model.named_parameters() if ".lora_" in name
        }  # fmt: skip
        self.scales = {
            name: float(module.scaling[ADAPTER])
            for name, module in self.model.named_modules()
            if hasattr(module, "lora_A") and ADAPTER in getattr(module, "scaling", {})
        }

    def load(self, adapter: Mapping[str, torch.Tensor]) -> None:
        """Overwrite every A and B with ``adapter``'s (PEFT names); names or shapes that do not
        fit the sampler's layers are a `ConfigError` raised before any tensor is written."""
        mine = {_held_name(k): v for k, v in adapter.items()}
        missing = sorted(set(self.tensors) - set(mine))
        extra = sorted(set(mine) - set(self.tensors))
        shapes = [k for k in mine if k in self.tensors and mine[k].shape != self.tensors[k].shape]
        if missing or extra or shapes:
            raise ConfigError(
                f"adapter sync to the sampler: the adapter lacks {missing[:3]}, has unexpected "
                f"{extra[:3]} and shapes that differ for {shapes[:3]}; the trainer's adapter and "
                "the sampler's must come from the same model.lora (rank, target_modules) and "
                "model config"
            )
        with torch.no_grad():
            for name, tensor in mine.items():
                self.tensors[name].copy_(tensor)

    def fingerprint(self) -> Fingerprint:
        """The adapter as the sampler holds it, counted as `unirl.core.weights.adapter` says
        (B times the layer's own scale)."""
        out = Fingerprint()
        with torch.no_grad():
            for name, tensor in self.tensors.items():
                scale = self.scales[name.rsplit(".lora_", 1)[0]]
                out.add(_peft_name(name), scaled_for_fingerprint(
                    name, tensor, scale=scale, dtype=tensor.dtype
                ))  # fmt: skip
        return out

    def base_fingerprint(self) -> Fingerprint:
        """The base weights' fingerprint (every parameter but the adapter's)."""
        out = Fingerprint()
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if ".lora_" not in name:
                    out.add(name, param)
        return out

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the adapter is held in (what the trainer's fingerprint casts to)."""
        return next(iter(self.tensors.values())).dtype
