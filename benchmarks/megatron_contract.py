"""The Megatron backend's contract on GPUs: every clause of the contract suite (`tests/contract`)
for each layout, each launched with torchrun (``python -m torch.distributed.run``), in fp32 and
bf16, plus the headline numbers:

- per-token log-prob max abs error against the Hugging Face fp32 reference (clause 1);
- loss and gradient norm of every RL-step variant relative to the 1-GPU fp32 run;
- progress-bar updates == microbatches on every layout (clause 6);
- reuse == recompute (clause 5).

Layouts: padded batches (``megatron.attention: padded``) on {1 GPU, TP=2, PP=2, PP=2 x VPP=2,
DP=2}; packed sequences (THD, the default) on {1 GPU, TP=2, CP=2, PP=2 x VPP=2, DP=2}; and the
4- and 8-GPU layouts, which run where the GPUs exist and are recorded as skipped elsewhere.

Fixtures. The contract's tiny Llama (4 layers: PP=2 x VPP=2 needs a layer per virtual stage).
fp32 runs use the suite's init std of 0.2, whose large logits make a misaligned
or mis-tempered log-prob show. bf16 error grows with the logits' size: bf16 runs use the std of
real checkpoints' init (0.02, HF's ``initializer_range`` default), and each fixture's row
``hf_bf16_floor`` gives the error of the Hugging Face model itself run in bf16 against its fp32
self (a yardstick for what bf16 rounding alone costs on that fixture); one 1-GPU bf16 run on the std-0.2 fixture
shows the difference. Each bf16 row is compared with the fp32 1-GPU run on its own fixture.
Each fixture has its own ``grad_clip`` below every variant's gradient norm
(`tests.contract.fixtures.GRAD_CLIP_BY_INIT_STD`: 0.2 for std 0.02, whose gradients are ~3x
smaller), so that clause 3 tests clipping on every row and every clause passes by design.

Layouts run ``--jobs`` at a time (they share the GPUs: the models are tiny). Results go to one
JSON file, rewritten after every layout so that a run stopped by a deadline keeps what finished::

    PYTHONPATH=$PWD python benchmarks/megatron_contract.py --jobs 4 \
        --out benchmarks/results/megatron_contract/<date>_h200_<commit>_2gpu.json

``--fused-head on`` runs every layout with ``model.fused_head: true`` (the last stage hands its
hidden states and the output layer's weight shard to core; no logits), names unchanged; the
table records the setting.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.contract_table import logprob_calls
from benchmarks.run_environment import run_environment
from tests.contract import clauses, critic, fixtures, harness, launch
from tests.contract.backends import Layout, with_fused_head

logger = logging.getLogger("megatron_contract")

PADDED = {"attention": "padded"}
LAYOUTS = (
    Layout.of("tp1-pp1-dp1", 1, options=PADDED),
    Layout.of("tp2", 2, options=PADDED, tp=2),
    Layout.of("pp2", 2, options=PADDED, pp=2),
    Layout.of("pp2-vpp2", 2, options=PADDED, pp=2, vpp=2),
    Layout.of("dp2", 2, options=PADDED),
    Layout.of("packed", 1),
    # whole-layer recompute keeping attention's output (model.recompute_attention: false)
    Layout.of(
        "packed-kept-attention",
        1,
        model={"gradient_checkpointing": True, "recompute_attention": False},
    ),
    Layout.of("packed-tp2", 2, tp=2),
    Layout.of("packed-tp2-sp", 2, tp=2, sequence_parallel=True),  # torch norms, no TE
    Layout.of("packed-cp2", 2, cp=2),
    Layout.of("packed-pp2-vpp2", 2, pp=2, vpp=2),
    Layout.of("packed-dp2", 2),
    # 4 GPUs
    Layout.of("tp2-pp2", 4, options=PADDED, tp=2, pp=2),
    Layout.of("tp2-pp2-vpp2", 4, options=PADDED, tp=2, pp=2, vpp=2),
    Layout.of("packed-tp2-pp2-vpp2", 4, tp=2, pp=2, vpp=2),
    Layout.of("packed-tp2-cp2", 4, tp=2, cp=2),
    Layout.of("dp2-tp2", 4, options=PADDED, tp=2),
    Layout.of("packed-dp2-tp2", 4, tp=2),
    # 8 GPUs
    Layout.of("packed-tp2-pp2-cp2-vpp2", 8, tp=2, pp=2, cp=2, vpp=2),
    Layout.of("dp2-tp2-pp2", 8, options=PADDED, tp=2, pp=2),
    Layout.of("packed-dp2-tp2-pp2", 8, tp=2, pp=2),
)
BASELINE_LAYOUT = "tp1-pp1-dp1"
# (run name, dtype, fixture init std, layouts: None = all)
RUNS = (
    ("fp32", "fp32", 0.2, None),
    ("bf16", "bf16", 0.02, None),
    ("fp32-std0.02", "fp32", 0.02, (BASELINE_LAYOUT,)),  # the bf16 rows' baseline
    ("bf16-std0.2", "bf16", 0.2, (BASELINE_LAYOUT, "packed")),
)
# NVLink multicast stays off on shared hosts (device README); torchrun passes the environment on.
SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
LAYOUT_TIMEOUT_S = 150
_NEXT_GPU = itertools.count()  # thread-safe enough: next() on a count is atomic under the GIL


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
        run_job = critic.run_critic_job if isinstance(job, critic.CriticJob) else harness.run_job
        result = run_job(rank, world, job)
        torch.save(result, job_file.with_name(f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


# -- the driver ---------------------------------------------------------------------------------


def run_layout(
    layout: Layout,
    dtype: str,
    model_dir: Path,
    records: list,
    root: Path,
    run: str,
    *,
    with_critic: bool = False,
) -> Any:
    """The policy's contract group, or (``with_critic``) the critic's (`tests.contract.critic`)."""
    work = root / f"{run}-{layout.name}{'-critic' if with_critic else ''}"
    work.mkdir(parents=True, exist_ok=True)
    job_type = critic.CriticJob if with_critic else harness.Job
    job = job_type(
        backend="megatron",
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
    env = {**os.environ, **SAFE_ENV, "UNIRL_PROGRESS": "1", "OMP_NUM_THREADS": "2"}
    gpus = torch.cuda.device_count()
    if gpus > layout.world_size and "CUDA_VISIBLE_DEVICES" not in os.environ:
        # spread parallel jobs over the GPUs (each group starts at LOCAL_RANK 0)
        first = next(_NEXT_GPU) % (gpus - layout.world_size + 1)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(first + i) for i in range(layout.world_size))
    t0 = time.perf_counter()
    # own process group: a timeout kills torchrun's workers too (else they keep the GPUs busy)
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = proc.communicate(timeout=LAYOUT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    ranks = []
    for r in range(layout.world_size):
        out = work / f"rank{r}.pt"
        if not out.is_file():
            raise RuntimeError(
                f"rank {r} wrote no result (torchrun exit {proc.returncode}):\n{stderr[-6000:]}"
            )
        ranks.append(torch.load(out, weights_only=False))
    return clauses.Measured(ranks, wall_s=wall), " ".join(cmd)


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


def hf_bf16_floor(model_dir: Path, records: list, ref: clauses.ReferenceResults) -> float:
    """Max abs error of the HF model's own bf16 log-probs against its fp32 ones (run on the CPU,
    in the driver process)."""
    from tests.contract import reference

    model = reference.load_model(model_dir).to(torch.bfloat16)
    got = reference.batch_logprobs(model, records, fixtures.TEMPERATURE)
    return max(
        float((g.double() - ref.logprobs[i].double()).abs().max())
        for i, g in enumerate(got)
        if g.numel()
    )


def prepare_fixture(root: Path, std: float) -> tuple[Path, list, clauses.ReferenceResults, float]:
    fixtures.TINY_LLAMA["initializer_range"] = std
    model_dir, records = launch.prepare(root / f"std{std}")
    ref = clauses.compute_reference(model_dir, records)
    return model_dir, records, ref, hf_bf16_floor(model_dir, records, ref)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=False)
    parser.add_argument("--runs", default=",".join(r[0] for r in RUNS))
    parser.add_argument("--layouts", default="", help="comma-separated names (default: all)")
    parser.add_argument("--jobs", type=int, default=1, help="layouts run at the same time")
    parser.add_argument("--deadline-s", type=float, default=1e9, help="start no layout after")
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--fused-head", choices=("on", "off"), default="off", help="model.fused_head everywhere"
    )
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker)
        return
    if args.out is None:
        parser.error("--out is required")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    t_start = time.monotonic()
    root = args.work_dir or Path(tempfile.mkdtemp(prefix="unirl-megatron-contract-"))
    root.mkdir(parents=True, exist_ok=True)
    wanted_runs = {x for x in args.runs.split(",") if x}
    runs = [r for r in RUNS if r[0] in wanted_runs]
    stds = sorted({r[2] for r in runs})
    prepared = {std: prepare_fixture(root, std) for std in stds}
    critic_refs = {
        std: critic.compute_critic_reference(prepared[std][0], prepared[std][1]) for std in stds
    }
    wanted = {x for x in args.layouts.split(",") if x}
    layouts = [y for x in LAYOUTS if (y := with_fused_head(x, args.fused_head)) is not None]
    gpus = torch.cuda.device_count()
    table: dict[str, Any] = {
        "model": {**fixtures.TINY_LLAMA, "initializer_range": {r[0]: r[2] for r in runs}},
        "hf_bf16_floor": {f"std{std}": prepared[std][3] for std in stds},
        "environment": run_environment(),
        "fused_head": args.fused_head == "on",
        "tolerance": {d: {"rtol": t.rtol, "atol": t.atol} for d, t in clauses.TOLERANCES.items()},
        "layouts": {
            x.name: {
                "world_size": x.world_size,
                "parallel": x.parallel_dict,
                "options": x.options_dict,
                "model": x.model_dict,
            }
            for x in layouts
        },
        "results": {},
    }
    jobs = []
    for run, dtype, std, only in runs:
        for layout in layouts:
            if (wanted and layout.name not in wanted) or (only and layout.name not in only):
                continue
            row: dict[str, Any] = {"world_size": layout.world_size, "fixture_std": std}
            table["results"].setdefault(run, {})[layout.name] = row
            if layout.world_size > gpus:
                row["skipped"] = f"needs {layout.world_size} GPUs, {gpus} here"
                continue
            jobs.append((run, dtype, std, layout, row))

    lock = threading.Lock()

    def one(job: tuple) -> None:
        run, dtype, std, layout, row = job
        out: dict[str, Any] = {}
        if time.monotonic() - t_start > args.deadline_s:
            out["skipped"] = f"deadline of {args.deadline_s} s reached"
        else:
            model_dir, records, ref, _ = prepared[std]
            logger.info("%s / %s: running", run, layout.name)
            try:
                m, cmd = run_layout(layout, dtype, model_dir, records, root, run)
                tol = clauses.TOLERANCES[dtype]
                out["command"] = cmd
                out["wall_s"] = round(m.wall_s, 1)
                out["harness_errors"] = {k: v[-3000:] for k, v in m.errors.items()}
                # megatron-core patched for the CPU (unirl.backends.megatron.compat.cpu): on
                # GPUs this must be False
                out["cpu_compat_patched"] = any("cpu_compat_lines" in r for r in m.ranks)
                out["clauses"] = summarise(clauses.all_checks(m, ref, records, tol))
                out["headline"] = headline(m, ref)
                out["logprob_calls"] = logprob_calls(m)
                verdict = {c: ("ok" if e["ok"] else "FAIL") for c, e in out["clauses"].items()}
                logger.info("%s / %s: %.1f s %s", run, layout.name, m.wall_s, verdict)
                # PPO's critic (C1-C5), its own group of processes
                mc, _ = run_layout(layout, dtype, model_dir, records, root, run, with_critic=True)
                out["critic_wall_s"] = round(mc.wall_s, 1)
                out["critic_harness_errors"] = {k: v[-3000:] for k, v in mc.errors.items()}
                out["critic_clauses"] = summarise(
                    critic.grouped(critic.all_critic_checks(mc, critic_refs[std], records, tol))
                )
                verdict = {
                    c: ("ok" if e["ok"] else "FAIL") for c, e in out["critic_clauses"].items()
                }
                logger.info("%s / %s critic: %.1f s %s", run, layout.name, mc.wall_s, verdict)
            except Exception as err:  # a crash or hang of the whole group
                out["error"] = str(err)[-6000:]
                logger.info("%s / %s failed: %s", run, layout.name, str(err)[-2000:])
        with lock:
            row.update(out)
            _write(args.out, table)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        list(pool.map(one, jobs))
    baselines = {
        std: table["results"].get(run, {}).get(BASELINE_LAYOUT, {}).get("headline")
        for run, dtype, std, _ in runs
        if dtype == "fp32"
    }
    for run, _, std, _ in runs:
        for row in table["results"].get(run, {}).values():
            if "headline" in row and baselines.get(std):
                row["vs_1gpu_fp32"] = relative_to(baselines[std], row["headline"])
    table["total_s"] = round(time.monotonic() - t_start, 1)
    _write(args.out, table)


def _write(path: Path, table: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
