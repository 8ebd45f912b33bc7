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


def run_group_with_critic(
    entry: BackendEntry,
    layout: Layout,
    *,
    model_dir: Path,
    records: list[dict[str, Any]],
    work_dir: Path,
    critic_work_dir: Path,
) -> tuple[clauses.Measured, clauses.Measured | RuntimeError]:
    """`run_group` and `tests.contract.critic.run_critic_group` of one layout in one group of
    processes (CPU, fp32): (the contract's measurements, the critic's, or the critic job's
    error: its tests fail with it, the contract's do not)."""
    from tests.contract import critic

    job = contract_job(entry, layout, model_dir=model_dir, records=records, work_dir=work_dir)
    cjob = critic.critic_job(
        entry, layout, model_dir=model_dir, records=records, work_dir=critic_work_dir
    )
    t0 = time.perf_counter()
    ranks = run_distributed(
        critic.contract_then_critic, layout.world_size, (job, cjob),
        timeout=GROUP_TIMEOUT_S + critic.CRITIC_GROUP_TIMEOUT_S,
    )  # fmt: skip
    wall = time.perf_counter() - t0
    contract = clauses.Measured([r["contract"] for r in ranks], wall_s=wall)
    failed = [f"rank {i}:\n{r['critic_error']}" for i, r in enumerate(ranks) if "critic_error" in r]
    if failed:
        return contract, RuntimeError(
            "the critic job failed after the contract's\n" + "\n".join(failed)
        )
    return contract, clauses.Measured([r["critic"] for r in ranks], wall_s=wall)
