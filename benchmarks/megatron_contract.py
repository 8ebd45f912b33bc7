"""The Megatron backend's contract on GPUs: every clause of the contract suite (`tests/contract`)
for the layouts 1 GPU, TP=2, PP=2, PP=2 with VPP=2 and DP=2, each launched with torchrun
(``python -m torch.distributed.run``),
in fp32 and bf16, plus the headline numbers:

- per-token log-prob max abs error against the Hugging Face fp32 reference (clause 1);
- loss and gradient norm of every RL-step variant relative to the 1-GPU fp32 run;
- progress-bar updates == microbatches on every layout (clause 6);
- reuse == recompute (clause 5).

The fixture model is the contract's tiny Llama with 4 layers instead of 2 (PP=2 x VPP=2 needs a
layer per virtual stage). Results go to one JSON file, rewritten after every layout so that a run
stopped by a deadline keeps what finished::

    PYTHONPATH=$PWD python benchmarks/megatron_contract.py \\
        --out benchmarks/results/megatron_contract_h200.json

Known failures that are not the backend's (reported to the lead, see the JSON's ``notes``):
under TP every tensor-parallel rank returns the forward log-probs and the harness counts them
twice ("every sample once"; removed here before the checks, after checking the TP ranks agree
exactly); under PP, core's `RLStep` returns the loss metrics on the last stage only, so clause 2's
"rank 0 reports the reporting rank's metrics" fails.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tests.contract import clauses, fixtures, harness, launch
from tests.contract.backends import Layout

logger = logging.getLogger("megatron_contract")

BUILDER = "unirl.backends.megatron:build_backend"
NUM_LAYERS = 4
LAYOUTS = (
    Layout.of("tp1-pp1-dp1", 1),
    Layout.of("tp2", 2, tp=2),
    Layout.of("pp2", 2, pp=2),
    Layout.of("pp2-vpp2", 2, pp=2, vpp=2),
    Layout.of("dp2", 2),
)
BASELINE = ("fp32", "tp1-pp1-dp1")
# NVLink multicast stays off on shared hosts (device README); torchrun passes the environment on.
SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
LAYOUT_TIMEOUT_S = 150


# -- one rank under torchrun ------------------------------------------------------------------


def worker(job_file: Path) -> None:
    """Run the contract harness on this rank (NCCL, one GPU per rank) and save its results."""
    import torch.distributed as dist

    job = torch.load(job_file, weights_only=False)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")  # gloo: dry runs
    try:
        result = harness.run_job(rank, world, job)
        torch.save(result, job_file.with_name(f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


# -- the driver ---------------------------------------------------------------------------------


def run_layout(layout: Layout, dtype: str, model_dir: Path, records: list, root: Path) -> Any:
    work = root / f"{dtype}-{layout.name}"
    work.mkdir(parents=True, exist_ok=True)
    job = harness.Job(
        backend="megatron",
        builder=BUILDER,
        layout=layout,
        model_dir=str(model_dir),
        work_dir=str(work),
        records=records,
        dtype=dtype,
    )
    job_file = work / "job.pt"
    torch.save(job, job_file)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",  # torchrun
        "--standalone",
        f"--nproc_per_node={layout.world_size}",
        __file__,
        "--worker",
        str(job_file),
    ]
    env = {**os.environ, **SAFE_ENV, "UNIRL_PROGRESS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=LAYOUT_TIMEOUT_S, check=False
    )
    wall = time.perf_counter() - t0
    ranks = []
    for r in range(layout.world_size):
        out = work / f"rank{r}.pt"
        if not out.is_file():
            raise RuntimeError(
                f"rank {r} wrote no result (torchrun exit {proc.returncode}):\n"
                f"{proc.stderr[-6000:]}"
            )
        ranks.append(torch.load(out, weights_only=False))
    return clauses.Measured(ranks, wall_s=wall), " ".join(cmd)


def dedup_tensor_parallel(m: clauses.Measured, tp: int) -> float:
    """Keep the forward log-probs of tensor-parallel rank 0 only (the harness expects each sample
    once); returns the largest difference between TP ranks' copies (0: they agree exactly)."""
    if tp == 1:
        return 0.0
    worst = 0.0
    by_rank = {r["rank"]: r for r in m.ranks}
    for r in m.ranks:
        if r["rank"] % tp == 0:
            continue
        lead = by_rank[r["rank"] - r["rank"] % tp]
        for path in (("forward", "policy"), ("forward", "reference"), ("export", "logprobs")):
            mine, theirs = (
                r.get(path[0], {}).get(path[1], {}),
                lead.get(path[0], {}).get(path[1], {}),
            )
            for sample, values in mine.items():
                diff = (torch.tensor(values) - torch.tensor(theirs[sample])).abs().max()
                worst = max(worst, float(diff) if len(values) else 0.0)
            r.get(path[0], {})[path[1]] = {}
        if "resume" in r:
            r["resume"]["reference_after"] = {}
    return worst


def headline(m: clauses.Measured, ref: clauses.ReferenceResults) -> dict[str, Any]:
    """The log-prob error against HF fp32, and the loss / grad norm of every variant."""
    out: dict[str, Any] = {}
    try:
        m.need("forward")
        merged, _ = clauses.merged_forward(m, "forward", "policy")
        errs = [
            float((torch.tensor(merged[i]) - ref.logprobs[i].float()).abs().max())
            for i in merged
            if len(merged[i])
        ]
        out["logprob_max_abs_err_vs_hf_fp32"] = max(errs) if errs else None
    except clauses.SectionFailed as err:
        out["logprob_error"] = str(err)[-500:]
    out["variants"] = {}
    for name in fixtures.VARIANTS:
        try:
            metrics = m.variant(name)["metrics"]
        except clauses.SectionFailed:
            continue
        out["variants"][name] = {k: metrics.get(k) for k in ("loss", "grad_norm")}
    return out


def relative_to(baseline: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    rel: dict[str, Any] = {}
    worst = 0.0
    for name, values in row.get("variants", {}).items():
        base = baseline.get("variants", {}).get(name)
        if not base:
            continue
        entry = {}
        for key in ("loss", "grad_norm"):
            a, b = values.get(key), base.get(key)
            if a is None or b is None:
                continue
            entry[key] = abs(a - b) / max(abs(b), 1e-12)
            worst = max(worst, entry[key])
        rel[name] = entry
    return {"per_variant": rel, "max_rel_err": worst}


def summarise(checks: dict[str, list[clauses.Check]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, items in checks.items():
        clause = key.split(":")[0]
        entry = out.setdefault(clause, {"max_abs_err": 0.0, "ok": True, "checks": 0, "failed": []})
        for c in items:
            entry["checks"] += 1
            if c.max_abs != float("inf"):
                entry["max_abs_err"] = max(entry["max_abs_err"], c.max_abs)
            if not c.ok:
                entry["ok"] = False
                entry["failed"].append(c.describe()[:400])
    for entry in out.values():
        entry["failed"] = entry["failed"][:12]
    return dict(sorted(out.items()))


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "PYTHONPATH=$PWD python " + " ".join(sys.argv),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }
    for dist_name in ("transformers", "megatron-core"):
        try:
            env[dist_name] = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            env[dist_name] = None
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=False)
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--layouts", default="", help="comma-separated names (default: all)")
    parser.add_argument("--deadline-s", type=float, default=1e9, help="start no layout after")
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker)
        return
    if args.out is None:
        parser.error("--out is required")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    t_start = time.monotonic()
    fixtures.TINY_LLAMA["num_hidden_layers"] = NUM_LAYERS
    root = args.work_dir or Path(tempfile.mkdtemp(prefix="unirl-megatron-contract-"))
    root.mkdir(parents=True, exist_ok=True)
    model_dir, records = launch.prepare(root)
    ref = clauses.compute_reference(model_dir, records)
    wanted = {x for x in args.layouts.split(",") if x}
    table: dict[str, Any] = {
        "model": {**fixtures.TINY_LLAMA},
        "environment": environment(),
        "tolerance": {d: {"rtol": t.rtol, "atol": t.atol} for d, t in clauses.TOLERANCES.items()},
        "notes": [
            "tp layouts: forward log-probs deduplicated over TP ranks (tp_ranks_max_diff) before "
            "clause 1/7/8's 'every sample once' check",
            "pp layouts: clause 2 'rank 0 reports the reporting rank's metrics' fails because "
            "core RLStep returns loss metrics on the last pipeline stage only",
        ],
        "results": {},
    }
    baseline: dict[str, Any] | None = None
    for dtype in [d for d in args.dtypes.split(",") if d]:
        tol = clauses.TOLERANCES[dtype]
        for layout in LAYOUTS:
            if wanted and layout.name not in wanted:
                continue
            row: dict[str, Any] = {
                "world_size": layout.world_size,
                "parallel": layout.parallel_dict,
            }
            table["results"].setdefault(dtype, {})[layout.name] = row
            if time.monotonic() - t_start > args.deadline_s:
                row["skipped"] = f"deadline of {args.deadline_s} s reached"
                continue
            if torch.cuda.is_available() and layout.world_size > torch.cuda.device_count():
                row["skipped"] = f"needs {layout.world_size} GPUs"
                continue
            logger.info("%s / %s: running", dtype, layout.name)
            try:
                m, cmd = run_layout(layout, dtype, model_dir, records, root)
            except Exception as err:  # a crash or hang of the whole group
                row["error"] = str(err)[-6000:]
                logger.info("%s / %s failed: %s", dtype, layout.name, str(err)[-2000:])
                _write(args.out, table)
                continue
            tp = layout.parallel_dict.get("tp", 1)
            row["command"] = cmd
            row["wall_s"] = round(m.wall_s, 1)
            row["tp_ranks_max_diff"] = dedup_tensor_parallel(m, tp)
            row["harness_errors"] = {k: v[-3000:] for k, v in m.errors.items()}
            row["clauses"] = summarise(clauses.all_checks(m, ref, records, tol))
            row["headline"] = headline(m, ref)
            if (dtype, layout.name) == BASELINE:
                baseline = row["headline"]
            if baseline is not None:
                row["vs_1gpu_fp32"] = relative_to(baseline, row["headline"])
            verdict = {c: ("ok" if e["ok"] else "FAIL") for c, e in row["clauses"].items()}
            logger.info("%s / %s: %.1f s %s", dtype, layout.name, m.wall_s, verdict)
            _write(args.out, table)
    table["total_s"] = round(time.monotonic() - t_start, 1)
    _write(args.out, table)


def _write(path: Path, table: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
