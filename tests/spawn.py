"""The one helper that runs a test function in several processes.

`run_distributed(fn, world_size, *args)` binds a free port, starts `world_size` processes that
each init a gloo process group, calls `fn(rank, world_size, *args)` and returns the list of
per-rank return values (which must pickle). An exception on any rank fails the test with that
rank's traceback. With gloo (the default, for the CPU tests) CUDA is never touched;
``backend="nccl"`` runs one process per GPU instead (the GPU benchmark scripts).

On a machine without CUDA the ranks are forked from one forkserver per test session that has
imported the heavy packages once (`tests.spawn_preload`): each rank of a fresh interpreter spent
5-8 CPU seconds importing them, and the suite starts about a hundred ranks. Each rank gets the
caller's environment as it is when `run_distributed` is called (a forked rank would otherwise
have the server's). A call whose environment differs from the server's in a variable the
preloaded packages read at import (``TRITON_INTERPRET``, OpenMP's, ...: `_IMPORT_TIME_ENV`)
gets fresh spawned interpreters, as does every call with CUDA (and ``backend="nccl"``) or with
``UNIRL_TEST_START_METHOD=spawn``. Forked ranks also see megatron-core's jit fuser off (the
preload imports ``unirl.backends.megatron`` first, as every rank that builds a Megatron backend
does), also where a test imports megatron-core directly.
"""

from __future__ import annotations

import io
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Environment variables the preloaded packages read when they are imported (Triton's interpreter
# switch, OpenMP / MKL thread settings read when torch loads, DeepSpeed's accelerator, Hugging
# Face settings, CUDA's device list): a rank forked from a server started under other values
# would run with the server's, so the call gets fresh interpreters instead.
_IMPORT_TIME_ENV = (
    "TRITON_", "OMP_", "MKL_", "KMP_", "GOMP_", "DS_", "HF_", "TRANSFORMERS_", "TORCH", "PYTORCH_",
    "CUDA_", "NVIDIA_", "MEGATRON", "NVTE_", "PYTHONHASHSEED",
)  # fmt: skip
_server_env: dict[str, str] | None = None  # those variables when this process's server started


def _import_time_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_IMPORT_TIME_ENV)}


def _start_method(backend: str) -> str:
    global _server_env
    if os.environ.get("UNIRL_TEST_START_METHOD") == "spawn" or backend == "nccl":
        return "spawn"
    if torch.cuda.is_available():  # a forked CUDA runtime is unusable: keep fresh interpreters
        return "spawn"
    if _server_env is None:
        _server_env = _import_time_env()  # the server starts with the first forked rank
    return "forkserver" if _import_time_env() == _server_env else "spawn"


def _context(method: str) -> Any:
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["tests.spawn_preload"])  # read when the server starts
    return ctx


def _worker(
    rank: int, world_size: int, port: int, backend: str, fn: Callable, args: tuple, queue: Any,
    env: dict[str, str] | None = None,
) -> None:  # fmt: skip
    if env is not None:  # forked from the server: the caller's environment, not the server's
        os.environ.clear()
        os.environ.update(env)
        # and fresh unseeded random streams, as a spawned interpreter has (forked ranks would all
        # share the server's); torch's is seeded by every test that relies on it
        import random
        import sys

        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    if backend == "gloo":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # torch.save bytes: tensors shared through the queue would vanish with the worker's
        # shared memory before the parent reads them
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # report every failure to the parent, then exit
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable, world_size: int, *args: Any, timeout: float = 300, backend: str = "gloo"
) -> list[Any]:
    method = _start_method(backend)
    ctx = _context(method)
    queue = ctx.SimpleQueue()
    port = free_port()
    env = dict(os.environ) if method == "forkserver" else None
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, backend, fn, args, queue, env),
            daemon=False,
        )
        for r in range(world_size)
    ]
    import time

    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < world_size:
            if time.monotonic() > deadline:
                break
            if queue.empty():
                if not any(p.is_alive() for p in procs) and queue.empty():
                    break
                time.sleep(0.02)
                continue
            rank, status, payload = queue.get()
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
    finally:  # also on a pytest timeout or ^C: no rank outlives its test
        for p in procs:
            if p.pid is None:
                continue
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    if errors:
        raise AssertionError("\n".join(errors))
    if len(results) != world_size:
        missing = sorted(set(range(world_size)) - set(results))
        raise AssertionError(f"ranks {missing} did not finish within {timeout}s (hang or crash)")
    return [results[r] for r in range(world_size)]
