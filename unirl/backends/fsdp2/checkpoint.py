"""Training checkpoints with `torch.distributed.checkpoint` (DCP): every rank writes its own shards
of the model and optimizer state in parallel, plus its RNG states; rank 0 writes the LR schedule
position and core's client state; `unirl.backends.hf.checkpoint` adds the RNG states and stages
and publishes the folder.

Layout of ``<path>/``::

    dcp/                   DCP files: {"model": ..., "optim": ...} (sharded parameters, AdamW moments;
                           under model.lora the adapter's only, not the frozen base)
    critic_dcp/            the critic's, the same way (when the run trains one)
    meta.pt                {"scheduler": ..., "optimizer_started": bool, "unirl": client_state}
    rng_rank00000.pt       python / numpy / torch CPU / CUDA generator states of rank 0, ...
    complete               written last by rank 0 (`unirl.core.run.checkpointing.publish`)

With the same world size a resumed run on the CPU is bit-exact (weights, moments, learning rate,
random streams).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from unirl.backends.fsdp2.model import Fsdp2Model
from unirl.backends.hf.checkpoint import CLIENT_KEY, Marker, Models
from unirl.core.run.checkpointing import load_state


def _forget_placeholder_state(optimizer: torch.optim.Optimizer) -> None:
    """`get_state_dict` gives an optimizer without state one by running a zero-gradient step at
    lr 0: the weights do not move, but AdamW's step count becomes 1, and the next real step's
    bias correction would then differ from an uninterrupted run's. Before the first real step
    the state is dropped again, on save (as it was) and on load (as it was when saved)."""
    optimizer.state.clear()


def _options(m: Fsdp2Model) -> StateDictOptions:
    """Frozen parameters (a LoRA policy's base) are neither saved nor expected on load."""
    frozen = not all(p.requires_grad for p in m.module.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def _save_model(folder: Path, m: Fsdp2Model) -> bool:
    started = bool(m.optimizer.state)
    model_sd, optim_sd = get_state_dict(m.module, m.optimizer, options=_options(m))
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder))
    if not started:
        _forget_placeholder_state(m.optimizer)
    return started


def _load_model(folder: Path, m: Fsdp2Model, started: bool, scheduler_state: Any) -> None:
    options = _options(m)
    model_sd, optim_sd = get_state_dict(m.module, m.optimizer, options=options)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(
        m.module,
        m.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=options,
    )
    if not started:
        _forget_placeholder_state(m.optimizer)
    m.scheduler.load_state_dict(scheduler_state)


def write_files(partial: Path, models: Models, client: Mapping[str, Any], rank: int) -> Marker:
    """Every rank its DCP shards (the critic's into ``<name>_dcp/``); rank 0 ``meta.pt``."""
    policy: Fsdp2Model = models.policy
    started = _save_model(partial / "dcp", policy)
    extra_meta = {
        name: {
            "optimizer_started": _save_model(partial / f"{name}_dcp", m),
            "scheduler": m.scheduler.state_dict(),
        }
        for name, m in models.extra.items()
    }
    if rank == 0:
        saved = {
            "scheduler": policy.scheduler.state_dict(),
            "optimizer_started": started,
            "extra": extra_meta,
            CLIENT_KEY: dict(client),
        }
        torch.save(saved, partial / "meta.pt")
    return {"sp": policy.options.sp, "sharding": policy.options.sharding}


def read_files(path: Path, models: Models) -> dict[str, Any]:
    policy: Fsdp2Model = models.policy
    meta = load_state(path / "meta.pt")
    _load_model(path / "dcp", policy, meta["optimizer_started"], meta["scheduler"])
    for name, m in models.extra.items():
        info = meta["extra"][name]
        _load_model(path / f"{name}_dcp", m, info["optimizer_started"], info["scheduler"])
    return dict(meta[CLIENT_KEY])
