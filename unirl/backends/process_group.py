"""Joining or creating the default process group, and picking this rank's device: one rule for
every backend.

unirl runs in one process without a launcher (world size 1: an in-memory store, no port to pick
or collide on) and under ``torchrun`` / the ``deepspeed`` launcher (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` from the environment). gloo on the CPU, NCCL on
GPUs. A process group created by the caller (a test harness, a larger program) is used as is, and
only a group created here is destroyed by `destroy_process_group`.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable

import attrs
import torch
import torch.distributed as dist

from unirl.backends.watchdog import record_peers
from unirl.core.config.run_config import ParallelConfig
from unirl.core.errors import ConfigError

# How long a collective may wait for the other ranks before the run fails, when
# parallel.timeout_s is not set: minutes on the CPU, longer on GPUs (NCCL's first collectives and
# large checkpoint saves, during which the other ranks wait in a barrier, can take minutes).
DEFAULT_TIMEOUT_S = {"gloo": 300.0, "nccl": 1800.0}


@attrs.frozen(kw_only=True)
class ProcessGroupSetup:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    owns_process_group: bool  # we created it, so `destroy_process_group` destroys it


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment {name}={raw!r} is not an integer") from None


def init_process_group(parallel: ParallelConfig) -> ProcessGroupSetup:
    """Join the default process group or create it; set and return this rank's device (the GPU
    ``LOCAL_RANK`` modulo the visible GPUs, else the CPU)."""
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = _env_int("LOCAL_RANK", rank)
    else:
        rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
        local_rank = _env_int("LOCAL_RANK", rank if world > 1 else 0)
    if parallel.world_size is not None and parallel.world_size != world:
        raise ConfigError(
            f"parallel.world_size={parallel.world_size} but {world} processes were launched; "
            "launch that many ranks or remove parallel.world_size"
        )
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    owns = not dist.is_initialized()
    if owns:
        backend = "nccl" if device.type == "cuda" else "gloo"
        if world == 1 and "MASTER_ADDR" not in os.environ:
            # No launcher: an in-memory store needs no address or port.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            timeout = collective_timeout(parallel, backend)
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
            _timeout_for_new_groups(timeout)
            record_peers()  # so that a rank that times out can stop a hung one (watchdog)
    return ProcessGroupSetup(
        rank=rank, world_size=world, local_rank=local_rank, device=device, owns_process_group=owns
    )


def collective_timeout(parallel: ParallelConfig, backend: str) -> datetime.timedelta:
    """How long a collective of this run may wait: ``parallel.timeout_s``, else the default of
    the communication backend (``"gloo"`` or ``"nccl"``)."""
    return datetime.timedelta(seconds=parallel.timeout_s or DEFAULT_TIMEOUT_S[backend])


def _timeout_for_new_groups(timeout: datetime.timedelta) -> None:
    """Groups the engines create later (DeepSpeed's data-parallel group, Megatron's model-parallel
    groups) do not inherit the default group's timeout: ``new_group(timeout=None)`` takes torch's
    module default (30 minutes), and a rank that hangs in their collectives (gradient all-reduce)
    would hang the job that long. torch keeps that default in a module global of
    `torch.distributed.distributed_c10d`; set it for this process."""
    from torch.distributed import distributed_c10d

    distributed_c10d.default_pg_timeout = timeout
    distributed_c10d.default_pg_nccl_timeout = timeout


# Engines that cache process-group objects register how to drop them (`on_destroy`): a group
# created by someone else (the serve runtime, a test) may be destroyed under them, and a later
# group in this process must not meet the stale ones.
_ON_DESTROY: list[Callable[[], None]] = []


def on_destroy(release: Callable[[], None]) -> None:
    """Run ``release`` when `destroy_process_group` destroys the default group (once)."""
    if release not in _ON_DESTROY:
        _ON_DESTROY.append(release)


def destroy_process_group(setup: ProcessGroupSetup) -> None:
    """Destroy the default process group if `init_process_group` created it."""
    if setup.owns_process_group and dist.is_initialized():
        for release in _ON_DESTROY:
            release()
        dist.destroy_process_group()
