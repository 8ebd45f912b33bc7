"""Training checkpoints with `torch.distributed.checkpoint` (DCP): every rank writes its own shards
of the model and optimizer state in parallel, plus its RNG states; rank 0 writes the LR schedule
position and core's client state.

Layout of ``<path>/``::

    dcp/                   DCP files: {"model": ..., "optim": ...} (sharded parameters, AdamW moments)
    meta.pt                {"scheduler": ..., "optimizer_started": bool, "unirl": client_state}
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

import attrs
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from unirl.core.errors import ConfigError
from unirl.core.run.checkpointing import partial_dir, publish, read_marker, rng_state, set_rng_state

_CLIENT_KEY = "unirl"


def _rng_file(folder: Path, rank: int) -> Path:
    return folder / f"rng_rank{rank:05d}.pt"


def _forget_placeholder_state(optimizer: torch.optim.Optimizer) -> None:
    """`get_state_dict` gives an optimizer without state one by running a zero-gradient step at
    lr 0: the weights do not move, but AdamW's step count becomes 1, and the next real step's
    bias correction would then differ from an uninterrupted run's. Before the first real step
    the state is dropped again, on save (as it was) and on load (as it was when saved)."""
    optimizer.state.clear()


@attrs.frozen
class TrainedModel:
    """Another trained model of the run (the critic), saved beside the policy under its name."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any


def _save_model(folder: Path, m: TrainedModel) -> bool:
    started = bool(m.optimizer.state)
    model_sd, optim_sd = get_state_dict(m.model, m.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder))
    if not started:
        _forget_placeholder_state(m.optimizer)
    return started


def _load_model(folder: Path, m: TrainedModel, started: bool, scheduler_state: Any) -> None:
    model_sd, optim_sd = get_state_dict(m.model, m.optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(
        m.model, m.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    if not started:
        _forget_placeholder_state(m.optimizer)
    m.scheduler.load_state_dict(scheduler_state)


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
    extra: Mapping[str, TrainedModel] | None = None,
) -> None:
    """Collective: every rank calls it with the same `path`; ``extra`` models (the critic) go
    into ``<name>_dcp/`` of the same folder."""
    extra = dict(extra or {})
    path = Path(path)
    partial = partial_dir(path)
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by an earlier crash
        partial.mkdir(parents=True)
    dist.barrier()
    started = _save_model(partial / "dcp", TrainedModel(model, optimizer, scheduler))
    extra_meta = {
        name: {
            "optimizer_started": _save_model(partial / f"{name}_dcp", m),
            "scheduler": m.scheduler.state_dict(),
        }
        for name, m in extra.items()
    }
    torch.save(rng_state(), _rng_file(partial, rank))
    if rank == 0:
        saved = {
            "scheduler": scheduler.state_dict(),
            "optimizer_started": started,
            "extra": extra_meta,
            _CLIENT_KEY: dict(client_state),
        }
        torch.save(saved, partial / "meta.pt")
    dist.barrier()
    if rank == 0:
        publish(partial, path, {"world_size": world_size, **meta}, client_state=client_state)
    dist.barrier()


def load_checkpoint(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    path: Path,
    *,
    rank: int,
    world_size: int,
    extra: Mapping[str, TrainedModel] | None = None,
) -> dict[str, Any]:
    """Restore model, optimizer, LR position, the ``extra`` models and this rank's RNG; returns
    the client state."""
    path = Path(path)
    marker = read_marker(path)
    if marker["world_size"] != world_size:
        raise ConfigError(
            f"checkpoint {str(path)!r} was written by {marker['world_size']} ranks, this run has "
            f"{world_size}; resume with the same number of ranks"
        )
    meta = torch.load(path / "meta.pt", weights_only=False)
    _load_model(
        path / "dcp",
        TrainedModel(model, optimizer, scheduler),
        meta["optimizer_started"],
        meta["scheduler"],
    )
    saved_extra = meta.get("extra", {})
    for name, m in (extra or {}).items():
        if name not in saved_extra:
            raise ConfigError(
                f"checkpoint {str(path)!r} holds no {name} state (it was written by a run "
                f"without a {name}); resume with the config that wrote it, or start a new run"
            )
        info = saved_extra[name]
        _load_model(path / f"{name}_dcp", m, info["optimizer_started"], info["scheduler"])
    set_rng_state(torch.load(_rng_file(path, rank), weights_only=False))
    return dict(meta[_CLIENT_KEY])
