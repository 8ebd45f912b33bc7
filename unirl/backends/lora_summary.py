"""What ``unirl check`` says about ``model.lora``: the adapter's targets and trainable parameter
count (from the model's shapes, built on the meta device: nothing is allocated or loaded), what
the reference is, what the weight sync sends, what the run exports and that a critic stays a full
fine-tune. The count is every backend's: one A ``[rank, in]`` and one B ``[out, rank]`` per
adapted linear (Megatron's fused layers carry one adapter per Hugging Face target)."""

from __future__ import annotations

from typing import Any

from unirl.backends.peft_experts import FUSED_EXPERTS, expert_adapter_numel
from unirl.core.config.run_config import UnirlConfig, critic_enabled
from unirl.core.config.sections.lora import LoraConfig


def _meta_model(cfg: UnirlConfig) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    m = cfg.model
    if m.path is not None:
        config = AutoConfig.from_pretrained(m.path, local_files_only=True)
    else:
        fields = dict(m.hf_config or {})
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def adapter_size(model: Any, lora: LoraConfig, backend: str) -> tuple[int, int, int]:
    """(adapted linears, adapter parameters, base parameters) of ``model`` under ``lora`` on
    ``backend``; with ``target_experts`` each routed expert's projections count too, as the
    backend holds them (Megatron: an A and B per expert and target; DeepSpeed / FSDP2: peft's
    adapter per fused tensor, `unirl.backends.peft_experts`)."""
    import torch

    linears = params = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in lora.target_modules:
            linears += 1
            params += lora.rank * (module.in_features + module.out_features)
        if not (lora.target_experts and name.endswith(".experts")):
            continue
        for leaf, p in module.named_parameters(recurse=False):
            targets = [t for t in FUSED_EXPERTS.get(leaf, ()) if t in lora.target_modules]
            if p.dim() != 3 or not targets:
                continue
            experts, out, fan_in = p.shape
            linears += experts * len(targets)
            if backend == "megatron":  # per expert and target: gate and up split out
                params += experts * lora.rank * (len(targets) * fan_in + out)
            else:
                params += expert_adapter_numel(leaf, tuple(p.shape), lora.rank)
    return linears, params, sum(p.numel() for p in model.parameters())


def _size_line(cfg: UnirlConfig, lora: LoraConfig) -> str:
    try:
        linears, params, base = adapter_size(_meta_model(cfg), lora, cfg.backend)
    except Exception as exc:
        return f"trainable parameters: not counted ({type(exc).__name__}: {exc})"
    share = 100.0 * params / base if base else 0.0
    return (
        f"trainable parameters: {params:,} in {linears} adapted linears "
        f"({share:.2f}% of the base's {base:,}, which stay frozen)"
    )


def lora_summary(cfg: UnirlConfig) -> list[str]:
    """Lines for ``unirl check`` (empty without ``model.lora``)."""
    lora = cfg.model.lora
    if lora is None:
        return []
    from unirl.core.weight_sync import adapter_sync_note

    experts = "routed experts adapted too" if lora.target_experts else "routed experts not adapted"
    start = f"from {lora.path}" if lora.path else f"A from seed {lora.init_seed}, B zero"
    reference = (
        f"a separate model from model.ref_path={cfg.model.ref_path!r}"
        if cfg.model.ref_path
        else "the policy with its adapter off (the base model; no second copy of the weights)"
    )
    sync = adapter_sync_note(cfg) or "no weight sync: the source receives no weights"
    lines = [
        f"targets: {list(lora.target_modules)} ({experts})",
        f"rank {lora.rank}, alpha {lora.alpha:g} (scale {lora.scale:g}), dropout {lora.dropout:g}",
        f"adapter start: {start}",
        _size_line(cfg, lora),
        f"reference (KL): {reference}",
        f"weight sync: {sync}",
        f"export: {cfg.logging.run_dir}/adapter as a PEFT folder (`unirl convert BASE OUT "
        "--merge-adapter ADAPTER` merges it into a full model, on request only)",
    ]
    if critic_enabled(cfg):
        lines.append("critic: a full fine-tune (model.lora adapts the policy only)")
    return lines
