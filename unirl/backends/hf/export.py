"""Writing a trained model as a Hugging Face folder (``config.json`` + safetensors + the source's
tokenizer files), for a rollout engine or the Hub, the same on every HF engine: rank 0 writes into
``<path>.partial`` and renames it, so a crash leaves no half-written export. The engine gathers
the full state dict (its own collective) before."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from unirl.core.config.run_config import ModelConfig

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


def write_hf_folder(
    module: Any,
    state: Mapping[str, torch.Tensor] | None,
    model_cfg: ModelConfig,
    path: Path,
    *,
    rank: int,
    dtype: torch.dtype | None = None,
) -> None:
    """Collective: every rank calls it after gathering; rank 0 saves ``module`` with ``state``
    (``None``: rank 0's ``state_dict()``) into `path`. ``dtype``: what the exported config names
    (FSDP2 trains fp32 masters of a bf16 model)."""
    path = Path(path)
    if rank == 0:
        if state is None:
            state = {k: v.detach().cpu() for k, v in module.state_dict().items()}
        partial = path.with_name(path.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        config = module.config
        # Training turns the KV cache off; a model exported for generation wants it on.
        saved = config.use_cache, config.dtype
        config.use_cache = True
        if dtype is not None:
            config.dtype = dtype
        try:
            module.save_pretrained(str(partial), state_dict=dict(state))
        finally:
            config.use_cache, config.dtype = saved
        if model_cfg.path is not None:
            source = Path(model_cfg.path).expanduser()
            for name in TOKENIZER_FILES:
                if (source / name).is_file() and not (partial / name).exists():
                    shutil.copy2(source / name, partial / name)
        if path.exists():
            shutil.rmtree(path)
        os.replace(partial, path)
    dist.barrier()
