"""The policy's weights in Hugging Face layout: a folder (``config.json`` + safetensors) and the
in-memory state dict on every rank (the weight sync to a rollout engine).

FSDP2 keeps Hugging Face's parameter names (it swaps the module classes, not the tree), so the
only work is gathering the shards (`get_model_state_dict` with ``full_state_dict``) and casting
the fp32 masters to the model's dtype (bf16 runs export bf16 weights, as the other backends do).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from unirl.backends.deepspeed.export import TOKENIZER_FILES
from unirl.core.run.config import ModelConfig


def hf_state_dict(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Collective: every rank gets the full weights as CPU tensors in `dtype`."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {
        k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype)
        for k, v in full.items()
    }


def export_hf(
    model: Any, model_cfg: ModelConfig, dtype: torch.dtype, path: Path, *, rank: int
) -> None:
    """Collective: every rank calls it; rank 0 writes `path` (via ``<path>.partial``)."""
    path = Path(path)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # full copy on rank 0 only
    state = get_model_state_dict(model, options=options)
    if rank == 0:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        partial = path.with_name(path.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        config = model.config
        use_cache, config.use_cache = config.use_cache, True  # exported for generation
        saved_dtype, config.dtype = config.dtype, dtype
        try:
            model.save_pretrained(str(partial), state_dict=state)
        finally:
            config.use_cache, config.dtype = use_cache, saved_dtype
        if model_cfg.path is not None:
            source = Path(model_cfg.path).expanduser()
            for name in TOKENIZER_FILES:
                if (source / name).is_file() and not (partial / name).exists():
                    shutil.copy2(source / name, partial / name)
        if path.exists():
            shutil.rmtree(path)
        os.replace(partial, path)
    dist.barrier()
