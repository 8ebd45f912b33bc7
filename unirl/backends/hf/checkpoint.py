"""The part of a training checkpoint that is the same on every HF engine: the staging folder,
each rank's RNG states, the ``complete`` marker and the rename that publishes the folder
(`unirl.core.run.checkpointing`), and the checks on load. The engine writes and reads its own
model and optimizer files (`CheckpointFiles`).

Every rank writes into ``<path>.partial``; after a barrier rank 0 syncs every file to disk, writes
``complete`` (with every file's size) and renames the folder to ``<path>`` (one rename: readers
see all or nothing). Loading refuses a folder without ``complete`` and one written by another
number of ranks.

Under ``model.lora`` the engine's files hold the adapter and its optimizer state, not the frozen
base: the base is re-read from ``model.path`` (or rebuilt from ``model.hf_config`` +
``model.init_seed``) exactly as the first run read it, so resume stays exact. The marker records
a fingerprint of that base (``lora_base``) and loading refuses another base, and a LoRA
checkpoint resumed without LoRA or the other way round.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import attrs
import torch
import torch.distributed as dist

from unirl.core.errors import ConfigError
from unirl.core.run.checkpointing import (
    load_state,
    partial_dir,
    publish,
    read_marker,
    rng_state,
    set_rng_state,
)

CLIENT_KEY = "unirl"  # core's client state, inside the engine's own files
Marker = dict[str, Any]  # what a checkpoint's ``complete`` marker records


@attrs.frozen
class Models:
    """The trained models of a run: the policy and the others (the critic) by name."""

    policy: Any
    extra: Mapping[str, Any]


class CheckpointFiles(Protocol):
    """An engine's own checkpoint files (models, optimizers, LR positions, the client state)."""

    def write_files(
        self, partial: Path, models: Models, client: Mapping[str, Any], rank: int
    ) -> Marker:
        """Collective: write into the staging folder; returns what the marker records beside
        the world size."""
        ...

    def read_files(self, path: Path, models: Models) -> dict[str, Any]:
        """Restore the models; the client state saved with them."""
        ...


def _rng_file(folder: Path, rank: int) -> Path:
    return folder / f"rng_rank{rank:05d}.pt"


def save_checkpoint(
    files: CheckpointFiles,
    policy: Any,
    path: Path,
    client_state: Mapping[str, Any],
    *,
    rank: int,
    world_size: int,
    extra: Mapping[str, Any],
    lora_base: str | None = None,
) -> None:
    """Collective: every rank calls it with the same `path`. ``lora_base``: under
    ``model.lora``, the base weights' fingerprint (`unirl.backends.hf.lora.base_fingerprint`),
    recorded in the marker: the engine's files then hold the adapter, not the frozen base."""
    path = Path(path)
    partial = partial_dir(path)
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by an earlier crash
        partial.mkdir(parents=True)
    dist.barrier()
    own = files.write_files(partial, Models(policy, extra), client_state, rank)
    torch.save(rng_state(), _rng_file(partial, rank))
    dist.barrier()
    if rank == 0:
        marker = {"world_size": world_size, **own, "engines": sorted(extra)}
        if lora_base is not None:
            marker["lora_base"] = lora_base
        publish(partial, path, marker, client_state=client_state)
    dist.barrier()


def check_lora_base(path: Path, saved: str | None, current: str | None) -> None:
    """A LoRA checkpoint holds the adapter only: it resumes onto the same base weights (re-read
    from model.path or rebuilt from model.hf_config + init_seed), and a full one without LoRA."""
    if saved == current:
        return
    where = f"checkpoint {str(path)!r}"
    if saved is None:
        raise ConfigError(
            f"{where} holds full weights (written without model.lora); resume it without "
            "model.lora, or start a new LoRA run"
        )
    if current is None:
        raise ConfigError(
            f"{where} holds a LoRA adapter only (written with model.lora); set model.lora as in "
            "the run that wrote it"
        )
    raise ConfigError(
        f"{where} holds an adapter trained on other base weights (fingerprint {saved}, this "
        f"run's base is {current}); set model.path / model.hf_config / model.init_seed / "
        "model.dtype as in the run that wrote it"
    )


def load_checkpoint(
    files: CheckpointFiles,
    policy: Any,
    path: Path,
    *,
    rank: int,
    world_size: int,
    extra: Mapping[str, Any],
    lora_base: str | None = None,
) -> dict[str, Any]:
    """Restore every model and this rank's RNG states; returns the client state."""
    path = Path(path)
    marker = read_marker(path)
    check_lora_base(path, marker.get("lora_base"), lora_base)
    if marker["world_size"] != world_size:
        raise ConfigError(
            f"checkpoint {str(path)!r} was written by {marker['world_size']} ranks, this run has "
            f"{world_size}; resume with the same number of ranks"
        )
    saved = marker.get("engines", [])  # absent in checkpoints of runs before the critic
    for name in extra:
        if name not in saved:
            raise ConfigError(
                f"checkpoint {str(path)!r} holds no {name} state (it was written by a run "
                f"without a {name}); resume with the config that wrote it, or start a new run"
            )
    client = files.read_files(path, Models(policy, extra))
    set_rng_state(load_state(_rng_file(path, rank)))
    return client
