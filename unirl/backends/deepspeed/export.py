"""A DeepSpeed-trained model's weights in Hugging Face layout: as a folder
(`unirl.backends.hf.export.write_hf_folder`) and as an in-memory state dict on every rank (the
per-step weight sync to a rollout engine). The HF module is what DeepSpeed trains, so its
parameter names are already Hugging Face's; only ZeRO-3's partitions need gathering, one module
at a time so the whole model is never materialised on the device at once.

For the folder the partitions are gathered onto rank 0 only
(`engine._zero3_consolidated_16bit_state_dict`, which keeps the parameters' own dtype)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from unirl.backends.hf.export import write_hf_folder
from unirl.core.config.run_config import ModelConfig


def hf_state_dict(engine: Any) -> dict[str, torch.Tensor]:
    """Collective under ZeRO-3: every rank gets the full weights (and persistent buffers), as CPU
    copies in the module's dtype."""
    module = engine.module
    if engine.zero_optimization_stage() != 3:
        return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
    import deepspeed

    state: dict[str, torch.Tensor] = {}

    def gather(mod: torch.nn.Module, prefix: str) -> None:
        params = list(mod.parameters(recurse=False))
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            for name, param in mod.named_parameters(recurse=False):
                state[prefix + name] = param.detach().to("cpu", copy=True)
        for name, buf in mod.named_buffers(recurse=False):
            if name not in mod._non_persistent_buffers_set:
                state[prefix + name] = buf.detach().to("cpu", copy=True)
        for name, child in mod.named_children():
            gather(child, f"{prefix}{name}.")

    gather(module, "")
    return state


def trainable_state_dict(engine: Any) -> dict[str, torch.Tensor]:
    """Collective under ZeRO-3: every rank gets the parameters that require grad (a LoRA
    adapter), gathered together (no frozen weight is gathered), as CPU copies."""
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    if engine.zero_optimization_stage() != 3:
        return {n: p.detach().to("cpu", copy=True) for n, p in named}
    import deepspeed

    with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
        return {n: p.detach().to("cpu", copy=True) for n, p in named}


def export_hf(engine: Any, model_cfg: ModelConfig, path: Path, *, rank: int) -> None:
    """Collective: every rank calls it; rank 0 writes `path`."""
    state = (
        engine._zero3_consolidated_16bit_state_dict()
        if engine.zero_optimization_stage() == 3
        else None
    )
    write_hf_folder(engine.module, state, model_cfg, Path(path), rank=rank)
