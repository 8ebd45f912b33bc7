"""DeepSpeed's communication on top of the shared process group (`unirl.backends.process_group`),
and the lock around DeepSpeed's CPU op build.

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
import fcntl
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from unirl.backends.engine_output import engine_prints
from unirl.backends.process_group import ProcessGroupSetup, init_process_group, on_destroy
from unirl.core.config.run_config import ParallelConfig

logger = logging.getLogger(__name__)

SHM_OP_NAME = "deepspeed_shm_comm"
STALE_BATON_ENV = "UNIRL_STALE_BATON_S"
_STALE_BATON_DEFAULT_S = 300.0


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


# Launcher variables `init_distributed` set because no launcher had (name -> value).
_ENV_SET_HERE: dict[str, str] = {}


def init_distributed(parallel: ParallelConfig) -> ProcessGroupSetup:
    """Join or create the default process group (`unirl.backends.process_group`), then DeepSpeed's
    communication backend."""
    import deepspeed

    setup = init_process_group(parallel)
    # DeepSpeed reads these in places (e.g. the engine's local rank). Those set here are removed
    # again by `close_distributed`: left behind, they tell the next library in this process
    # (accelerate, say) that a launcher started it.
    for name, value in (
        ("RANK", setup.rank),
        ("WORLD_SIZE", setup.world_size),
        ("LOCAL_RANK", setup.local_rank),
    ):
        if name not in os.environ:
            os.environ[name] = str(value)
            _ENV_SET_HERE[name] = str(value)
    with engine_prints():  # DeepSpeed prints "... built successfully" for its op, twice
        prebuild_shm_op()
        deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
    on_destroy(_release_deepspeed_groups)
    return setup


def _release_deepspeed_groups() -> None:
    """DeepSpeed's cached groups, dropped when the default group is destroyed by its owner."""
    from deepspeed.utils import groups

    groups._release_process_group_references(group=None)


def close_distributed(setup: ProcessGroupSetup) -> None:
    """Destroy the process group if `init_distributed` created it, through DeepSpeed so that it
    also drops its cached groups (a later backend in this process then starts clean)."""
    if setup.owns_process_group and dist.is_initialized():
        import deepspeed.comm

        deepspeed.comm.destroy_process_group()
    for name, value in list(_ENV_SET_HERE.items()):
        if os.environ.get(name) == value:
            del os.environ[name]
        del _ENV_SET_HERE[name]
