"""The policy's weights in Hugging Face layout: as a folder (``config.json`` + safetensors, for a
rollout engine or the Hub) and as an in-memory state dict on every rank (the per-step weight
sync to a rollout engine). The HF module is what DeepSpeed trains, so its parameter names are
already Hugging Face's; only ZeRO-3's partitions need gathering, one module at a time so the
whole model is never materialised on the device at once.

For the folder the partitions are gathered onto rank 0 only
(`engine._zero3_consolidated_16bit_state_dict`, which keeps the parameters' own dtype); rank 0
writes into ``<path>.partial`` and renames it, so a crash leaves no half-written export."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from unirl.core.run.config import ModelConfig

# Files a rollout engine needs beside the weights, copied from the source folder when present.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)


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


def export_hf(engine: Any, model_cfg: ModelConfig, path: Path, *, rank: int) -> None:
    """Collective: every rank calls it; rank 0 writes `path`."""
    path = Path(path)
    state = (
        engine._zero3_consolidated_16bit_state_dict()
        if engine.zero_optimization_stage() == 3
        else None
    )
    if rank == 0:
        partial = path.with_name(path.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        module = engine.module
        if state is None:
            state = {k: v.detach().cpu() for k, v in module.state_dict().items()}
        # Training turns the KV cache off; a model exported for generation wants it on.
        use_cache, module.config.use_cache = module.config.use_cache, True
        try:
            module.save_pretrained(str(partial), state_dict=state)
        finally:
            module.config.use_cache = use_cache
        if model_cfg.path is not None:
            source = Path(model_cfg.path).expanduser()
            for name in TOKENIZER_FILES:
                if (source / name).is_file() and not (partial / name).exists():
                    shutil.copy2(source / name, partial / name)
        if path.exists():
            shutil.rmtree(path)
        os.replace(partial, path)
    dist.barrier()
