"""An FSDP2-trained model's weights in Hugging Face layout: a folder
(`unirl.backends.hf.export.write_hf_folder`) and the in-memory state dict on every rank (the
weight sync to a rollout engine).

FSDP2 keeps Hugging Face's parameter names (it swaps the module classes, not the tree), so the
only work is gathering the shards (`get_model_state_dict` with ``full_state_dict``) and casting
the fp32 masters to the model's dtype (bf16 runs export bf16 weights, as the other backends do).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from unirl.backends.hf.export import write_hf_folder
from unirl.core.config.run_config import ModelConfig


def hf_state_dict(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Collective: every rank gets the full weights as CPU tensors in `dtype`."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {
        k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype)
        for k, v in full.items()
    }


def trainable_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: every rank gets the full parameters that require grad (a LoRA adapter; the
    frozen ones are neither gathered nor returned) as CPU tensors in their master dtype."""
    options = StateDictOptions(full_state_dict=True, ignore_frozen_params=True)
    full = get_model_state_dict(model, options=options)
    return {k: v.detach().to("cpu", copy=True) for k, v in full.items()}


def export_hf(
    model: Any, model_cfg: ModelConfig, dtype: torch.dtype, path: Path, *, rank: int
) -> None:
    """Collective: every rank calls it; rank 0 writes `path` (via ``<path>.partial``)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # full copy on rank 0 only
    state = get_model_state_dict(model, options=options)
    if rank == 0:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    write_hf_folder(model, state, model_cfg, Path(path), rank=rank, dtype=dtype)
