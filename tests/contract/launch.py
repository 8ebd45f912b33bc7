"""Start one (backend, layout) group: gloo processes on the CPU (`tests.spawn.run_distributed`), or
one NCCL process per GPU on a CUDA machine (the GPU table). Also builds the shared fixture files.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

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


def job_fields(
    entry: BackendEntry, layout: Layout, *, model_dir: Path, records: list[dict[str, Any]],
    work_dir: Path, dtype: str = "fp32",
) -> dict[str, Any]:  # fmt: skip
    """What a contract job and a critic job of one layout share."""
    return {
        "backend": entry.name,
        "layout": layout,
        "model_dir": str(model_dir),
        "work_dir": str(work_dir),
        "records": records,
        "dtype": dtype,
    }


def contract_job(entry: BackendEntry, layout: Layout, **fields: Any) -> harness.Job:
    return harness.Job(**job_fields(entry, layout, **fields), fixture=layout.fixture)


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
    job = contract_job(entry, layout, model_dir=model_dir, records=records, work_dir=work_dir,
                       dtype=dtype)  # fmt: skip
    t0 = time.perf_counter()
    backend = "gloo" if device == "cpu" else "nccl"  # NCCL: one process per GPU
    ranks = run_distributed(
        harness.run_job, layout.world_size, job, timeout=GROUP_TIMEOUT_S, backend=backend
    )
    return clauses.Measured(ranks, wall_s=time.perf_counter() - t0)


@attrs.frozen
class Companion:
    """A job run after a layout's contract job in the same processes (`contract_then`): only the
    process start and the imports are shared, each job builds its own backend (the harness
    builds and closes several per group already). ``run``: its module-level job function,
    ``timeout_s``: its share of the group's time limit."""

    name: str
    run: Callable[[int, int, Any], dict[str, Any]]
    job: Any
    timeout_s: float


def contract_then(rank: int, world_size: int, jobs: tuple[harness.Job, tuple]) -> dict:
    """The contract job (`tests.contract.harness.run_job`), then each companion's in order. A
    companion that raises is its own tests' failure (the contract's numbers still count); the
    ones after it do not run (the other ranks may still wait in its collectives)."""
    contract, companions = jobs
    out: dict[str, Any] = {"contract": harness.run_job(rank, world_size, contract)}
    for i, companion in enumerate(companions):
        try:
            out[companion.name] = companion.run(rank, world_size, companion.job)
        except Exception:
            out[f"{companion.name}_error"] = traceback.format_exc()
            for later in companions[i + 1 :]:
                out[f"{later.name}_error"] = f"not run: the {companion.name} job failed first"
            break
    return out


def run_group_with(
    entry: BackendEntry,
    layout: Layout,
    *,
    model_dir: Path,
    records: list[dict[str, Any]],
    work_dir: Path,
    companions: Sequence[Companion],
) -> tuple[clauses.Measured, dict[str, clauses.Measured | RuntimeError]]:
    """`run_group` and the ``companions``' jobs of one layout in one group of processes (CPU,
    fp32): (the contract's measurements, per companion its measurements or its job's error:
    its tests fail with it, the contract's do not)."""
    job = contract_job(entry, layout, model_dir=model_dir, records=records, work_dir=work_dir)
    timeout = GROUP_TIMEOUT_S + sum(c.timeout_s for c in companions)
    t0 = time.perf_counter()
    ranks = run_distributed(
        contract_then, layout.world_size, (job, tuple(companions)), timeout=timeout
    )
    wall = time.perf_counter() - t0
    contract = clauses.Measured([r["contract"] for r in ranks], wall_s=wall)
    results: dict[str, clauses.Measured | RuntimeError] = {}
    for c in companions:
        failed = [f"rank {i}:\n{r[c.name + '_error']}" for i, r in enumerate(ranks)
                  if c.name + "_error" in r]  # fmt: skip
        if failed:
            results[c.name] = RuntimeError(
                f"the {c.name} job failed after the contract's\n" + "\n".join(failed)
            )
        else:
            results[c.name] = clauses.Measured([r[c.name] for r in ranks], wall_s=wall)
    return contract, results
