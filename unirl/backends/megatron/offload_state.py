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

megatron chains one distributed optimizer per parameter kind (dense and expert parameters of a
mixture-of-experts model; with virtual pipeline stages possibly more), each with its own
`HybridDeviceOptimizer`: every one is saved, into a file of its own per rank
(``optimizer_host_rank{r}_{i}.pt``), and a checkpoint with another count is refused (a missed
one would restart from zero moments without a word).

Host memory: the state is written from the host tensors themselves (no second copy of the whole
state at each checkpoint) and read back memory-mapped (``mmap=True``, a private mapping: the
Adam step's writes stay in memory, never reach the file), so a resume holds no loaded copy beside
the state either.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from unirl.backends.megatron.optimizer import inner_optimizers
from unirl.core.errors import ConfigError


def hybrids_of(optimizer: Any) -> list[Any]:
    """Every `HybridDeviceOptimizer` inside a (chained) megatron optimizer, in chain order;
    empty when not offloaded."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    return [o for o in inner_optimizers(optimizer) if isinstance(o, HybridDeviceOptimizer)]


def _inner_params(hybrid: Any) -> list[tuple[Any, torch.Tensor]]:
    """(sub-optimizer, its parameter) for every parameter the sub-optimizers step, in order."""
    return [(o, p) for o in hybrid.sub_optimizers for g in o.param_groups for p in g["params"]]


def host_file(folder: Path, rank: int, index: int) -> Path:
    """Rank ``rank``'s file of its ``index``-th offloaded optimizer."""
    return folder / f"optimizer_host_rank{rank:05d}_{index}.pt"


def host_files(folder: Path, rank: int) -> list[Path]:
    """The offloaded optimizers' files of one rank in a checkpoint folder."""
    return sorted(folder.glob(f"optimizer_host_rank{rank:05d}_*.pt"))


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself when on the host (no copy), else its host copy."""
    return tensor.detach().cpu()


def save_host_state(hybrids: list[Any], folder: Path, rank: int) -> None:
    """This rank's master copies and Adam state, one file per offloaded optimizer."""
    for index, hybrid in enumerate(hybrids):
        entries = []
        for opt, param in _inner_params(hybrid):
            state = {k: _host(v) if torch.is_tensor(v) else v for k, v in opt.state[param].items()}
            entries.append({"master": _host(param), **state})
        torch.save(entries, host_file(folder, rank, index))


def load_host_state(hybrids: list[Any], folder: Path, rank: int) -> None:
    """Restore `save_host_state`'s files into the sub-optimizers, and the master weights into
    the model's shards (the same values as the distributed checkpoint's weights, rounded)."""
    files = host_files(folder, rank)
    if len(files) != len(hybrids):
        raise ConfigError(
            f"checkpoint {str(folder)!r} holds {len(files)} offloaded optimizer state file(s) of "
            f"rank {rank}, this run has {len(hybrids)} offloaded optimizer(s) there (dense and "
            "expert parameters, virtual pipeline chunks); resume with the model and parallel "
            "settings that wrote it"
        )
    for index, hybrid in enumerate(hybrids):
        _load_one(hybrid, host_file(folder, rank, index))


def _load_one(hybrid: Any, path: Path) -> None:
    """One offloaded optimizer from its file: the moments stay memory-mapped (module
    docstring), the masters are copied into the host copies megatron steps."""
    entries = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    params = _inner_params(hybrid)
    if len(entries) != len(params):
        raise ConfigError(
            f"{path}: {len(entries)} offloaded optimizer entries for {len(params)} parameters; "
            "resume with the model and parallel settings that wrote it"
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


def reset_host_state(hybrids: list[Any]) -> None:
    """Never-stepped offloaded optimizers at the model's current weights: no Adam state, each
    master copy taken from its shard."""
    for hybrid in hybrids:
        with torch.no_grad():
            for opt, param in _inner_params(hybrid):
                opt.state = defaultdict(dict)
                param.copy_(hybrid.inner_param_to_orig_param[param])
        hybrid.state = defaultdict(dict)
