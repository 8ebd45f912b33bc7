"""Training checkpoints with `torch.distributed.checkpoint` (DCP): every rank writes its own shards
of the model and optimizer state in parallel, plus its RNG states; rank 0 writes the LR schedule
position and core's client state.

Layout of ``<path>/``::

    dcp/                   DCP files: {"model": ..., "optim": ...} (sharded parameters, AdamW moments)
    meta.pt                {"scheduler": ..., "unirl": client_state} (rank 0)
    rng_rank00000.pt       python / numpy / torch CPU / CUDA generator states of rank 0, ...
    complete               written last by rank 0 (`unirl.core.run.checkpointing.publish`)

Every rank writes into ``<path>.partial``; the rename after the marker makes the checkpoint
appear whole or not at all. With the same world size a resumed run on the CPU is bit-exact
(weights, moments, learning rate, random streams).
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from unirl.core.errors import ConfigError
from unirl.core.run.checkpointing import partial_dir, publish, read_marker, rng_state, set_rng_state

_CLIENT_KEY = "unirl"


def _rng_file(folder: Path, rank: int) -> Path:
    return folder / f"rng_rank{rank:05d}.pt"


def save_checkpoint(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    path: Path,
    client_state: Mapping[str, Any],
    *,
    rank: int,
    world_size: int,
    meta: Mapping[str, Any],
) -> None:
    """Collective: every rank calls it with the same `path`."""
    path = Path(path)
    partial = partial_dir(path)
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by an earlier crash
        partial.mkdir(parents=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(partial / "dcp"))
    torch.save(rng_state(), _rng_file(partial, rank))
    if rank == 0:
        torch.save(
            {"scheduler": scheduler.state_dict(), _CLIENT_KEY: dict(client_state)},
            partial / "meta.pt",
        )
    dist.barrier()
    if rank == 0:
        publish(partial, path, {"world_size": world_size, **meta})
    dist.barrier()


def load_checkpoint(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    path: Path,
    *,
    rank: int,
    world_size: int,
) -> dict[str, Any]:
    """Restore model, optimizer, LR position and this rank's RNG; returns the client state."""
    path = Path(path)
    marker = read_marker(path)
    if marker["world_size"] != world_size:
        raise ConfigError(
            f"checkpoint {str(path)!r} was written by {marker['world_size']} ranks, this run has "
            f"{world_size}; resume with the same number of ranks"
        )
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path / "dcp"))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    meta = torch.load(path / "meta.pt", weights_only=False)
    scheduler.load_state_dict(meta["scheduler"])
    set_rng_state(torch.load(_rng_file(path, rank), weights_only=False))
    return dict(meta[_CLIENT_KEY])
