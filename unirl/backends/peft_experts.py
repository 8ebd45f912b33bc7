"""Expert adapters on a Hugging Face mixture-of-experts model (``model.lora.target_experts``)
through peft's ``target_parameters``, for the DeepSpeed / FSDP2 policy and the built-in sampler.

transformers 5 holds a layer's routed experts as fused 3-D tensors, not linears (Qwen3-MoE:
``mlp.experts.gate_up_proj [E, 2F, H]`` and ``mlp.experts.down_proj [E, H, F]``), so peft's
``target_modules`` cannot reach them. peft 0.21's ``ParamWrapper`` adapts such a tensor with one
rank-r adapter per expert: A ``[r * E, in]``, B ``[out, r * E]`` (expert e's rows of A and
columns of B), applied as ``W_e + scale * B_e @ A_e`` while the experts run. Its PEFT names are
the experts module's (``mlp.experts.lora_A.weight`` for the last tensor wrapped, one
``.base_layer`` deeper for each one before it), and the exported ``adapter_config.json`` lists
the tensors in ``target_parameters``, so ``peft.PeftModel.from_pretrained`` rebuilds the same.

gate and up share one tensor, so they are adapted together: naming one of them alone is a config
error. peft (its transformers v4 -> v5 conversion, `peft.utils.transformers_weight_conversion`)
gives that tensor rank 2r and alpha 2 alpha, one rank r per projection at the same scale, so a
per-expert adapter (Megatron's export: ``experts.{e}.gate_proj.lora_A``) loads into it with B
block-diagonal; trained here, B's off-diagonal blocks train too, so the two layouts are equal at
the start and differ as an adapter class (Megatron's gate and up each keep their own A and B).
"""

from __future__ import annotations

import torch

from unirl.core.config.sections.lora import LoraConfig
from unirl.core.errors import ConfigError

# A fused expert tensor and the Hugging Face targets it holds.
FUSED_EXPERTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def fused_expert_tensors(model: torch.nn.Module) -> dict[str, tuple[int, int, int]]:
    """The fused 3-D expert tensors of ``model`` (leaf name -> ``(E, out, in)``), from its
    first experts module; empty for a dense model."""
    for name, module in model.named_modules():
        if not name.endswith(".experts"):
            continue
        found = {
            leaf: tuple(p.shape)
            for leaf, p in module.named_parameters(recurse=False)
            if leaf in FUSED_EXPERTS and p.dim() == 3
        }
        if found:
            return found  # type: ignore[return-value]
    return {}


def expert_targets(lora: LoraConfig) -> set[str]:
    """The targets an expert adapter can cover (``target_experts`` on)."""
    if not lora.target_experts:
        return set()
    return {t for held in FUSED_EXPERTS.values() for t in held} & set(lora.target_modules)


def expert_target_parameters(model: torch.nn.Module, lora: LoraConfig) -> list[str] | None:
    """peft's ``target_parameters`` for ``model.lora`` on ``model`` (``experts.gate_up_proj``,
    ``experts.down_proj``), None when ``target_experts`` is off. A model without fused experts,
    a gate or up target without the other, or no expert projection targeted is a `ConfigError`
    naming the key."""
    if not lora.target_experts:
        return None
    fused = fused_expert_tensors(model)
    if not fused:
        raise ConfigError(
            f"model.lora.target_experts: true, but {type(model).__name__} has no routed experts "
            "held as fused 3-D tensors (mlp.experts.gate_up_proj / down_proj); set "
            "model.lora.target_experts: false"
        )
    _refuse_transposed(model)
    out = []
    for leaf, held in FUSED_EXPERTS.items():
        named = [t for t in held if t in lora.target_modules]
        if named and len(named) != len(held):
            raise ConfigError(
                f"model.lora.target_modules names {named} but not {sorted(set(held) - set(named))}"
                f" with model.lora.target_experts: true; {type(model).__name__}'s experts fuse "
                f"{' and '.join(held)} into one tensor ({leaf}), adapted as one: name both or "
                "neither"
            )
        if named and leaf in fused:
            out.append(f"experts.{leaf}")
    if not out:
        raise ConfigError(
            "model.lora.target_experts: true, but model.lora.target_modules names no expert "
            f"projection; add {sorted({t for h in FUSED_EXPERTS.values() for t in h})} or set "
            "model.lora.target_experts: false"
        )
    return out


def _refuse_transposed(model: torch.nn.Module) -> None:
    """Experts stored ``[E, in, out]`` (an experts module with ``is_transposed``): peft adapts
    them, but the merged export and the adapter counts here assume ``[E, out, in]`` (for a square
    projection a transposed delta would pass unnoticed)."""
    for name, module in model.named_modules():
        if name.endswith(".experts") and getattr(module, "is_transposed", False):
            raise ConfigError(
                f"model.lora.target_experts: true, but {type(model).__name__}'s experts ({name}) "
                "are stored transposed ([experts, in, out]), which unirl's expert adapters do not "
                "handle yet; set model.lora.target_experts: false"
            )


def expert_adapter_numel(leaf: str, shape: tuple[int, int, int], rank: int) -> int:
    """Elements of peft's adapter on one fused expert tensor ``leaf`` of shape ``(E, out, in)``:
    A ``[r' * E, in]`` and B ``[out, r' * E]``, where r' is ``rank`` per projection the tensor
    holds (peft gives gate_up rank 2r and alpha 2 alpha: the scale stays alpha / r)."""
    experts, out, fan_in = shape
    return rank * len(FUSED_EXPERTS[leaf]) * experts * (fan_in + out)
