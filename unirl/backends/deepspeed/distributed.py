"""Process-group setup for the DeepSpeed backend, and the lock around DeepSpeed's CPU op build.

unirl runs in one process without a launcher (world size 1: an in-memory store, no port to pick
or collide on) and under ``torchrun`` / the ``deepspeed`` launcher (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` from the environment). gloo on the CPU, NCCL on
GPUs. A process group created by the caller (a test harness, a larger program) is used as is.

The op-build race. On the CPU accelerator, `deepspeed.init_distributed` JIT-compiles the shared
memory communication op (``deepspeed_shm_comm``, `deepspeed.comm.torch.build_shm_op`) in every
rank at once. torch guards the build with a "baton" file (``<build dir>/lock``, created with
O_EXCL) that waiters poll; concurrent ranks were seen aborting one rank. So every rank first
takes an exclusive ``fcntl.flock`` on ``<torch extensions root>/unirl_op_build.lock`` and builds
(or loads the cached ``.so``) under it: exactly one process compiles, the others find the cached
library, and the baton is never contended. The loaded op is cached in-process, so DeepSpeed's own
call afterwards does not touch the baton.

A killed build leaves the baton file behind and torch would then wait for it forever. Under the
flock no unirl process can be building, so a baton that stays untouched for
``UNIRL_STALE_BATON_S`` seconds (default 300; a build takes well under that) is treated as stale
and removed, with a warning naming the file. If a non-unirl process shares the extensions
directory and really is building, the wait covers it.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import torch
import torch.distributed as dist

from unirl.core.errors import ConfigError
from unirl.core.run.config import ParallelConfig

logger = logging.getLogger(__name__)

SHM_OP_NAME = "deepspeed_shm_comm"
STALE_BATON_ENV = "UNIRL_STALE_BATON_S"
_STALE_BATON_DEFAULT_S = 300.0


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


def _extensions_root() -> Path:
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


@contextlib.contextmanager
def op_build_lock(root: Path | None = None) -> Iterator[None]:
    """An exclusive, process-wide file lock for building or loading JIT ops (blocks until held;
    the OS drops it if the holder dies, unlike torch's baton)."""
    root = _extensions_root() if root is None else root
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "unirl_op_build.lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def clear_stale_baton(build_dir: Path, stale_after_s: float | None = None) -> bool:
    """Wait for torch's baton file in `build_dir` to go; remove it once it has been untouched
    for `stale_after_s` seconds. Call only while holding `op_build_lock`. True if removed."""
    if stale_after_s is None:
        stale_after_s = float(os.environ.get(STALE_BATON_ENV, _STALE_BATON_DEFAULT_S))
    baton = build_dir / "lock"
    while True:
        try:
            age = time.time() - baton.stat().st_mtime
        except FileNotFoundError:
            return False
        if age >= stale_after_s:
            logger.warning(
                "removing stale torch extension lock %s (untouched for %.0f s: a build was "
                "killed); set %s to change the threshold",
                baton,
                age,
                STALE_BATON_ENV,
            )
            baton.unlink(missing_ok=True)
            return True
        time.sleep(min(0.1, stale_after_s - age))


def prebuild_shm_op() -> None:
    """Build or load DeepSpeed's CPU shared-memory comm op under `op_build_lock` (see module
    docstring). A no-op on accelerators without the op (CUDA)."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.comm.torch import build_shm_op

    if get_accelerator().create_op_builder("ShareMemCommBuilder") is None:
        return
    with op_build_lock():
        clear_stale_baton(_extensions_root() / _build_folder() / SHM_OP_NAME)
        build_shm_op()


def _build_folder() -> str:
    """torch's per-interpreter/accelerator subfolder, e.g. ``py311_cpu`` (as cpp_extension names
    it when TORCH_EXTENSIONS_DIR is unset; with it set, torch builds directly under it)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return ""
    if torch.version.hip is not None:
        accel = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accel = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accel = "cpu"
    return (
        f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_{accel}"
    )


def init_distributed(parallel: ParallelConfig) -> DistributedSetup:
    """Join or create the default process group, then DeepSpeed's communication backend."""
    import deepspeed

    owns = False
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
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        if world == 1 and "MASTER_ADDR" not in os.environ:
            # No launcher: an in-memory store needs no address or port.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group(
                backend, rank=rank, world_size=world, timeout=datetime.timedelta(minutes=30)
            )
        owns = True
    # DeepSpeed reads these in places (e.g. the engine's local rank).
    for name, value in (("RANK", rank), ("WORLD_SIZE", world), ("LOCAL_RANK", local_rank)):
        os.environ.setdefault(name, str(value))
    prebuild_shm_op()
    deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
    return DistributedSetup(
        rank=rank, world_size=world, local_rank=local_rank, device=device, owns_process_group=owns
    )


def close_distributed(setup: DistributedSetup) -> None:
    """Destroy the process group if `init_distributed` created it, through DeepSpeed so that it
    also drops its cached groups (a later backend in this process then starts clean)."""
    if setup.owns_process_group and dist.is_initialized():
        import deepspeed.comm

        deepspeed.comm.destroy_process_group()
