"""Training checkpoints: DeepSpeed's own files (model, ZeRO optimizer partitions, LR scheduler)
plus each rank's RNG states and core's client state, staged and published by
`unirl.backends.hf.checkpoint` so that a crash never leaves a checkpoint that looks complete.

Layout of ``<path>/`` (on a filesystem every rank sees)::

    state/...              engine.save_checkpoint(tag="state"): module, optimizer (per ZeRO rank),
                           LR scheduler, and {"unirl": client_state}
    critic/...             the critic's engine, the same way (when the run trains one)
    rng_rank00000.pt       python / numpy / torch CPU / CUDA generator states of rank 0, ...
    complete               written last, by rank 0, after every rank has finished

With the same world size and ZeRO stage, a resumed run on the CPU is bit-exact: the same weights,
optimizer moments, learning rate and random streams.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from unirl.backends.deepspeed.model import DeepSpeedModel
from unirl.backends.hf.checkpoint import (
    CLIENT_KEY,
    begin_save,
    check_saved,
    finish_save,
    open_checkpoint,
    restore_rng,
)
from unirl.core.errors import ConfigError

TAG = "state"


def save_checkpoint(
    policy: DeepSpeedModel,
    path: Path,
    client_state: Mapping[str, Any],
    *,
    rank: int,
    world_size: int,
    extra: Mapping[str, DeepSpeedModel],
) -> None:
    """Collective: every rank calls it with the same `path`. ``extra``: more trained models of
    the run (the critic) by tag, saved into the same folder before it is published."""
    partial = begin_save(path, rank=rank)
    policy.engine.save_checkpoint(
        str(partial), tag=TAG, client_state={CLIENT_KEY: dict(client_state)}, save_latest=False
    )
    for tag, other in extra.items():
        other.engine.save_checkpoint(str(partial), tag=tag, save_latest=False)
    marker = {
        "world_size": world_size,
        "zero_stage": policy.engine.zero_optimization_stage(),
        "engines": sorted(extra),
    }
    finish_save(partial, path, rank=rank, marker=marker, client_state=client_state)


def load_checkpoint(
    policy: DeepSpeedModel,
    path: Path,
    *,
    rank: int,
    world_size: int,
    extra: Mapping[str, DeepSpeedModel],
) -> dict[str, Any]:
    """Restore the engines and this rank's RNG states; returns the client state saved with it."""
    path = Path(path)
    meta = open_checkpoint(path, world_size=world_size)
    load_path, client = policy.engine.load_checkpoint(
        str(path), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if load_path is None:
        raise ConfigError(f"checkpoint {str(path)!r}: DeepSpeed found no state under tag {TAG!r}")
    saved = set(meta.get("engines", []))
    for tag, other in extra.items():
        check_saved(path, tag, saved)
        if other.engine.load_checkpoint(str(path), tag=tag)[0] is None:
            raise ConfigError(f"checkpoint {str(path)!r}: DeepSpeed found no state under {tag!r}")
    restore_rng(path, rank=rank)
    return dict(client[CLIENT_KEY])
