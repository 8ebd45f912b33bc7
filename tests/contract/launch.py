"""Start one (backend, layout) group: gloo processes on the CPU (`tests.spawn.run_distributed`), or
one NCCL process per GPU on a CUDA machine (the GPU table). Also builds the shared fixture files.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tests.contract import clauses, fixture_sets, fixtures, harness, reference
from tests.contract.backends import BackendEntry, Layout
from tests.spawn import run_distributed

GROUP_TIMEOUT_S = 480.0


def prepare(root: Path, fixture: str = "dense") -> tuple[Path, list[dict[str, Any]]]:
    """Write the fixture's tiny model under `root` and build the rollout records from its
    log-probs."""
    model_dir = fixture_sets.write_model(fixture, root)
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
        layout=layout,
        model_dir=str(model_dir),
        work_dir=str(work_dir),
        records=records,
        dtype=dtype,
        fixture=layout.fixture,
    )
    t0 = time.perf_counter()
    backend = "gloo" if device == "cpu" else "nccl"  # NCCL: one process per GPU
    ranks = run_distributed(
        harness.run_job, layout.world_size, job, timeout=GROUP_TIMEOUT_S, backend=backend
    )
    return clauses.Measured(ranks, wall_s=time.perf_counter() - t0)
