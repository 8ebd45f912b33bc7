"""Where one contract layout's processes spend their time: wall and CPU seconds per harness section.

    PYTHONPATH=$PWD python benchmarks/contract_startup.py megatron tp1-pp1-dp1 [--check]

Runs the (backend, layout) group of `tests/contract` on the CPU exactly as the suite does
(`tests.contract.launch`), with each rank's sections (`tests.contract.harness.section`) also
timed in CPU seconds of that rank, and prints one JSON line: the group's wall time, rank 0's
wall and CPU seconds of its main sections ("build" includes importing the engine), each rank's
total CPU seconds (imports included) and which heavy modules the rank imported. On a machine shared
with other jobs the wall times follow its load (printed); the CPU seconds much less so.
``--check`` also runs clauses 1-3 and 5-8 against the reference and prints how many checks failed.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SECTIONS = ("build", "forward", "save_init", "resume:resumed", "total")
MODULES = ("torch._inductor.compile_fx", "torch._dynamo.convert_frame", "wandb", "triton")


def timed_job(rank: int, world_size: int, job: Any) -> dict[str, Any]:
    """`harness.run_job` with every section also timed in this process's CPU seconds."""
    from tests.contract import harness

    cpu: dict[str, float] = {}
    plain = harness.section

    @contextmanager
    def section(name: str, errors: dict[str, str], timings: dict[str, float]) -> Iterator[None]:
        c0 = time.process_time()
        try:
            with plain(name, errors, timings):
                yield
        finally:
            cpu[name] = time.process_time() - c0

    harness.section = section
    out = harness.run_job(rank, world_size, job)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["cpu"] = cpu
    out["rank_cpu_s"] = usage.ru_utime + usage.ru_stime
    out["modules"] = {m: m in sys.modules for m in MODULES}
    return out


def checks(ranks: list[dict[str, Any]], wall: float, model_dir: Path, records: list) -> dict:
    from tests.contract import clauses, fixtures

    tol = clauses.TOLERANCES["fp32"]
    group = clauses.Measured(ranks, wall_s=wall)
    ref = clauses.compute_reference(model_dir, records)
    found = clauses.clause1_forward(group, ref, tol) + clauses.clause5_reuse(group, tol)
    found += clauses.clause6_progress(group) + clauses.clause7_resume(group, ref, tol)
    found += clauses.clause8_export(group, records, tol)
    for variant in fixtures.VARIANTS:
        found += clauses.clause2_metrics(group, ref, variant, tol)
        found += clauses.clause3_update(group, ref, variant, tol)
    return {"checks": len(found), "failed": [c.describe() for c in found if not c.ok][:5]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("backend")
    parser.add_argument("layout")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    from tests.contract import harness, launch
    from tests.contract.backends import REGISTRY
    from tests.spawn import run_distributed

    entry = REGISTRY[args.backend]
    layout = next(lay for lay in entry.layouts if lay.name == args.layout)
    root = Path(tempfile.mkdtemp(prefix="contract-startup-"))
    model_dir, records = launch.prepare(root / "model")
    job = harness.Job(
        backend=entry.name,
        layout=layout,
        model_dir=str(model_dir),
        work_dir=str(root / "work"),
        records=records,
    )
    t0 = time.perf_counter()
    ranks = run_distributed(timed_job, layout.world_size, job, timeout=launch.GROUP_TIMEOUT_S)
    wall = time.perf_counter() - t0
    result = {
        "layout": f"{args.backend}/{args.layout}",
        "machine": "2 CPU cores, shared with other jobs",
        "load_1min": float(Path("/proc/loadavg").read_text().split()[0]),
        "wall_s": round(wall, 1),
        "rank0_wall_s": {k: round(v, 2) for k, v in ranks[0]["timings"].items() if k in SECTIONS},
        "rank0_cpu_s": {k: round(v, 2) for k, v in ranks[0]["cpu"].items() if k in SECTIONS},
        "rank_cpu_s": [round(r["rank_cpu_s"], 1) for r in ranks],
        "modules_imported": ranks[0]["modules"],
        "errors": {r["rank"]: sorted(r["errors"]) for r in ranks if r["errors"]},
    }
    if args.check:
        result.update(checks(ranks, wall, model_dir, records))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
