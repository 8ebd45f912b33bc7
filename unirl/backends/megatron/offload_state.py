"""Checkpoints of the offloaded optimizer (``optimizer.offload``): the host copies' state saved
and restored by unirl, not through megatron-core's sharded optimizer state.

megatron-core 0.16.1's distributed optimizer reaches its `HybridDeviceOptimizer` through paths
written for Transformer Engine's FusedAdam (``load_state_dict`` sizes the precision-aware master
weights for TE and, without TE, takes torch AdamW's ``step`` from the parameter groups) and, for
fp32 parameters, fails outright (``_update_fp32_params_by_new_state`` looks every parameter up
among the bf16 ones' fp32 copies: a KeyError, measured on the CPU). The state is simple: per
offloaded shard, its fp32 master copy in host memory and torch AdamW's ``exp_avg``,
``exp_avg_sq`` and ``step``. So each rank saves its own list of them, in the sub-optimizers'
parameter order, which the same parallel layout (the only one a checkpoint loads into,
`unirl.backends.megatron.checkpoint.load_checkpoint`) rebuilds identically; the model weights come
from the distributed checkpoint as always.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from unirl.backends.megatron.optimizer import inner_optimizers


def hybrid_of(optimizer: Any) -> Any | None:
    """The `HybridDeviceOptimizer` inside a megatron optimizer, or None (not offloaded)."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    found = [o for o in inner_optimizers(optimizer) if isinstance(o, HybridDeviceOptimizer)]
    return found[0] if found else None


def _inner_params(hybrid: Any) -> list[tuple[Any, torch.Tensor]]:
    """(sub-optimizer, its parameter) for every parameter the sub-optimizers step, in order."""
    return [(o, p) for o in hybrid.sub_optimizers for g in o.param_groups for p in g["params"]]


def host_file(folder: Path, rank: int) -> Path:
    return folder / f"optimizer_host_rank{rank:05d}.pt"


def save_host_state(hybrid: Any, path: Path) -> None:
    """This rank's master copies and Adam state, on the host."""
    entries = []
    for opt, param in _inner_params(hybrid):
        state = {
            k: v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v
            for k, v in opt.state[param].items()
        }
        entries.append({"master": param.detach().to("cpu", copy=True), **state})
    torch.save(entries, path)


def load_host_state(hybrid: Any, path: Path) -> None:
    """Restore `save_host_state`'s file into the sub-optimizers, and the master weights into
    the model's shards (the same values as the distributed checkpoint's weights, rounded)."""
    entries = torch.load(path, map_location="cpu", weights_only=True)
    params = _inner_params(hybrid)
    if len(entries) != len(params):
        raise RuntimeError(
            f"{path}: {len(entries)} offloaded optimizer entries for {len(params)} parameters"
        )
    with torch.no_grad():
        for (opt, param), entry in zip(params, entries):
            master = entry.pop("master")
            param.copy_(master)
            opt.state[param] = {
                k: v.to(param.device) if torch.is_tensor(v) else v for k, v in entry.items()
            }
            hybrid.inner_param_to_orig_param[param].copy_(param)
    hybrid._sync_sub_optimizers_state_to_hdo()


def reset_host_state(hybrid: Any) -> None:
    """A never-stepped offloaded optimizer at the model's current weights: no Adam state, each
    master copy taken from its shard."""
    with torch.no_grad():
        for opt, param in _inner_params(hybrid):
            opt.state = defaultdict(dict)
            param.copy_(hybrid.inner_param_to_orig_param[param])
    hybrid.state = defaultdict(dict)
