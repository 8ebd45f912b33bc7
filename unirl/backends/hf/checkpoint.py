"""The part of a training checkpoint that is the same on every HF engine: the staging folder,
each rank's RNG states, the ``complete`` marker and the rename that publishes the folder
(`unirl.core.run.checkpointing`), and the checks on load. The engine writes its own model and
optimizer files between `begin_save` and `finish_save`.

Every rank writes into ``<path>.partial``; after a barrier rank 0 syncs every file to disk, writes
``complete`` (with every file's size) and renames the folder to ``<path>`` (one rename: readers
see all or nothing). Loading refuses a folder without ``complete`` and one written by another
number of ranks.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from unirl.core.errors import ConfigError
from unirl.core.run.checkpointing import partial_dir, publish, read_marker, rng_state, set_rng_state

CLIENT_KEY = "unirl"  # core's client state, inside the engine's own files


def _rng_file(folder: Path, rank: int) -> Path:
    return folder / f"rng_rank{rank:05d}.pt"


def begin_save(path: Path, *, rank: int) -> Path:
    """Collective: an empty staging folder for `path`, seen by every rank."""
    partial = partial_dir(Path(path))
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by an earlier crash
        partial.mkdir(parents=True)
    dist.barrier()
    return partial


def finish_save(
    partial: Path,
    path: Path,
    *,
    rank: int,
    marker: Mapping[str, Any],
    client_state: Mapping[str, Any],
) -> None:
    """Collective, after every rank wrote its files: this rank's RNG states, then rank 0
    publishes the folder with ``marker`` (``world_size`` and what the engine checks on load)."""
    torch.save(rng_state(), _rng_file(partial, rank))
    dist.barrier()
    if rank == 0:
        publish(partial, Path(path), dict(marker), client_state=client_state)
    dist.barrier()


def open_checkpoint(path: Path, *, world_size: int) -> dict[str, Any]:
    """The marker of a complete checkpoint written by ``world_size`` ranks."""
    marker = read_marker(Path(path))
    if marker["world_size"] != world_size:
        raise ConfigError(
            f"checkpoint {str(path)!r} was written by {marker['world_size']} ranks, this run has "
            f"{world_size}; resume with the same number of ranks"
        )
    return marker


def check_saved(path: Path, name: str, saved: Any) -> None:
    """A run that trains model ``name`` (the critic) resumes only from a checkpoint holding it."""
    if name not in saved:
        raise ConfigError(
            f"checkpoint {str(path)!r} holds no {name} state (it was written by a run without "
            f"a {name}); resume with the config that wrote it, or start a new run"
        )


def restore_rng(path: Path, *, rank: int) -> None:
    set_rng_state(torch.load(_rng_file(Path(path), rank), weights_only=False))
