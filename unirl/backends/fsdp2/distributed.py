"""Joining or creating the default process group for the FSDP2 backend.

One process without a launcher (an in-memory store: no port to pick or collide on), or under
``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``); gloo on
the CPU, NCCL on GPUs. A process group created by the caller (a test harness) is used as is and
is not destroyed by `close_distributed`.
"""

from __future__ import annotations

import datetime
import os

import attrs
import torch
import torch.distributed as dist

from unirl.core.errors import ConfigError


@attrs.frozen(kw_only=True)
class DistributedSetup:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    owns_process_group: bool  # we created it, so `close` destroys it


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment {name}={raw!r} is not an integer") from None


def init_distributed(expected_world_size: int | None) -> DistributedSetup:
    owns = False
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = _env_int("LOCAL_RANK", rank)
    else:
        rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
        local_rank = _env_int("LOCAL_RANK", rank if world > 1 else 0)
    if expected_world_size is not None and expected_world_size != world:
        raise ConfigError(
            f"parallel.world_size={expected_world_size} but {world} processes were launched; "
            "launch that many ranks or remove parallel.world_size"
        )
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        if world == 1 and "MASTER_ADDR" not in os.environ:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group(
                backend, rank=rank, world_size=world, timeout=datetime.timedelta(minutes=30)
            )
        owns = True
    return DistributedSetup(
        rank=rank, world_size=world, local_rank=local_rank, device=device, owns_process_group=owns
    )


def close_distributed(setup: DistributedSetup) -> None:
    if setup.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
