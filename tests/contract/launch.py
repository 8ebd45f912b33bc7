"""Start one (backend, layout) group: gloo processes on the CPU (`tests.spawn.run_distributed`), or
one NCCL process per GPU on a CUDA machine (the GPU table). Also builds the shared fixture files.
"""

from __future__ import annotations

import io
import os
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from tests.contract import clauses, fixtures, harness, reference
from tests.contract.backends import BackendEntry, Layout
from tests.spawn import free_port, run_distributed

GROUP_TIMEOUT_S = 480.0


def prepare(root: Path) -> tuple[Path, list[dict[str, Any]]]:
    """Write the tiny model under `root` and build the rollout records from its log-probs."""
    model_dir = fixtures.write_tiny_model(root / "tiny-llama")
    with reference.single_thread():
        model = reference.load_model(model_dir)
        stubs = [{"prompt_tokens": p, "response_tokens": r} for p, r in fixtures.token_ids()]
        true = reference.batch_logprobs(model, stubs, fixtures.TEMPERATURE)
    return model_dir, fixtures.make_records(true)


def run_group(
    entry: BackendEntry,
    layout: Layout,
    *,
    model_dir: Path,
    records: list[dict[str, Any]],
    work_dir: Path,
    device: str = "cpu",
    dtype: str = "fp32",
) -> clauses.Measured:
    job = harness.Job(
        backend=entry.name,
        builder=entry.builder,
        layout=layout,
        model_dir=str(model_dir),
        work_dir=str(work_dir),
        records=records,
        dtype=dtype,
    )
    t0 = time.perf_counter()
    if device == "cpu":
        ranks = run_distributed(harness.run_job, layout.world_size, job, timeout=GROUP_TIMEOUT_S)
    else:
        ranks = _run_cuda(job, layout.world_size)
    return clauses.Measured(ranks, wall_s=time.perf_counter() - t0)


# -- CUDA: one process per GPU over NCCL --------------------------------------------------------


def _cuda_worker(rank: int, world_size: int, port: int, job: harness.Job, queue: Any) -> None:
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world_size)
        result = harness.run_job(rank, world_size, job)
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_cuda(job: harness.Job, world_size: int) -> list[dict[str, Any]]:
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_cuda_worker, args=(r, world_size, port, job, queue))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    deadline = time.monotonic() + GROUP_TIMEOUT_S
    while len(results) + len(errors) < world_size and time.monotonic() < deadline:
        if queue.empty():
            if not any(p.is_alive() for p in procs) and queue.empty():
                break
            time.sleep(0.05)
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
    if errors or len(results) != world_size:
        missing = sorted(set(range(world_size)) - set(results))
        raise RuntimeError("\n".join(errors) or f"ranks {missing} did not finish")
    return [results[r] for r in range(world_size)]
