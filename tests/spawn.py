"""The one helper that runs a test function in several processes.

`run_distributed(fn, world_size, *args)` binds a free port, starts `world_size` spawned
processes that each init a gloo process group, calls `fn(rank, world_size, *args)` and returns
the list of per-rank return values (which must pickle). An exception on any rank fails the test
with that rank's traceback. With gloo (the default, for the CPU tests) CUDA is never touched;
``backend="nccl"`` runs one process per GPU instead (the GPU benchmark scripts).
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


def _worker(
    rank: int, world_size: int, port: int, backend: str, fn: Callable, args: tuple, queue: Any
) -> None:
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
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker, args=(r, world_size, port, backend, fn, args, queue), daemon=False
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    import time

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
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    if len(results) != world_size:
        missing = sorted(set(range(world_size)) - set(results))
        raise AssertionError(f"ranks {missing} did not finish within {timeout}s (hang or crash)")
    return [results[r] for r in range(world_size)]
