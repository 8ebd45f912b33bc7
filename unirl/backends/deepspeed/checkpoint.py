"""Training checkpoints: DeepSpeed's own files (model, ZeRO optimizer partitions, LR scheduler)
plus each rank's RNG states and core's client state, written so that a crash never leaves a
checkpoint that looks complete.

Layout of ``<path>/`` (on a filesystem every rank sees)::

    state/...              engine.save_checkpoint(tag="state"): module, optimizer (per ZeRO rank),
                           LR scheduler, and {"unirl": client_state}
    critic/...             the critic's engine, the same way (when the run trains one)
    rng_rank00000.pt       python / numpy / torch CPU / CUDA generator states of rank 0, ...
    complete               written last, by rank 0, after every rank has finished

Every rank writes into ``<path>.partial``; after a barrier rank 0 syncs every file to disk, writes
``complete`` (with every file's size) and renames the folder to ``<path>`` (one rename: readers
see all or nothing). Loading refuses a folder
without ``complete``. With the same world size and ZeRO stage, a resumed run on the CPU is
bit-exact: the same weights, optimizer moments, learning rate and random streams.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from unirl.core.errors import ConfigError
from unirl.core.run.checkpointing import partial_dir, publish, read_marker, rng_state, set_rng_state

logger = logging.getLogger(__name__)

TAG = "state"
_CLIENT_KEY = "unirl"


def _rng_file(folder: Path, rank: int) -> Path:
    return folder / f"rng_rank{rank:05d}.pt"


def save_checkpoint(
    engine: Any,
    path: Path,
    client_state: Mapping[str, Any],
    *,
    rank: int,
    world_size: int,
    extra_engines: Mapping[str, Any] | None = None,
) -> None:
    """Collective: every rank calls it with the same `path`. ``extra_engines``: more engines of
    the run (the critic) by tag, saved into the same folder before it is published."""
    extra = dict(extra_engines or {})
    path = Path(path)
    partial = partial_dir(path)
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by an earlier crash
        partial.mkdir(parents=True)
    dist.barrier()
    engine.save_checkpoint(
        str(partial), tag=TAG, client_state={_CLIENT_KEY: dict(client_state)}, save_latest=False
    )
    for tag, other in extra.items():
        other.save_checkpoint(str(partial), tag=tag, save_latest=False)
    torch.save(rng_state(), _rng_file(partial, rank))
    dist.barrier()
    if rank == 0:
        publish(
            partial,
            path,
            {
                "world_size": world_size,
                "zero_stage": engine.zero_optimization_stage(),
                "engines": sorted(extra),
            },
            client_state=client_state,
        )
    dist.barrier()


def load_checkpoint(
    engine: Any,
    path: Path,
    *,
    rank: int,
    world_size: int,
    extra_engines: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Restore the engines and this rank's RNG states; returns the client state saved with it."""
    extra = dict(extra_engines or {})
    path = Path(path)
    meta = read_marker(path)
    if meta["world_size"] != world_size:
        raise ConfigError(
            f"checkpoint {str(path)!r} was written by {meta['world_size']} ranks, this run has "
            f"{world_size}; resume with the same number of ranks"
        )
    load_path, client = engine.load_checkpoint(
        str(path), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if load_path is None:
        raise ConfigError(f"checkpoint {str(path)!r}: DeepSpeed found no state under tag {TAG!r}")
    saved = set(meta.get("engines", []))
    for tag, other in extra.items():
        if tag not in saved:
            raise ConfigError(
                f"checkpoint {str(path)!r} holds no {tag} state (it was written by a run without "
                f"a {tag}); resume with the config that wrote it, or start a new run"
            )
        if other.load_checkpoint(str(path), tag=tag)[0] is None:
            raise ConfigError(f"checkpoint {str(path)!r}: DeepSpeed found no state under {tag!r}")
    set_rng_state(torch.load(_rng_file(path, rank), weights_only=False))
    return dict(client[_CLIENT_KEY])
