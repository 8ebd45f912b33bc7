"""The backend contract as a table: backend x layout x clause -> the measured error.

Runs the clauses of the contract suite (`tests/contract`) on this machine for the given backends
and layouts, and writes, for every (backend, layout, clause), the largest absolute and relative
error against the single-process fp32 reference, whether it is within the tolerance of the
chosen dtype, and the failing checks. On a GPU machine each layout runs one process per GPU
(NCCL); on the CPU, gloo processes. The reference itself always runs in fp32 on the CPU.

    PYTHONPATH=$PWD python benchmarks/contract_table.py --device cuda --dtype bf16 \\
        --out benchmarks/results/contract_table/<date>_h200_<commit>_deepspeed-bf16.json
    PYTHONPATH=$PWD python benchmarks/contract_table.py --device cpu --dtype fp32 \\
        --backends deepspeed --layouts zero0-dp1,zero3-dp2 --out /tmp/contract_cpu.json

The ``moe-*`` layouts run the tiny Qwen3-MoE fixture (`tests.contract.moe_fixture`), with the
router-loss and routing-replay clauses; the critic's clauses run on the dense fixture only:

    PYTHONPATH=$PWD python benchmarks/contract_table.py --device cuda --dtype fp32 \\
        --backends megatron,deepspeed,fsdp2 \\
        --layouts moe-ep1,moe-ep2,moe-tp2-ep2-sp,moe-pp2,moe-ep2-etp2,moe-pp2-ep2,\\
moe-zero1-dp2,moe-full-dp2 \\
        --no-critic --out benchmarks/results/contract_table/<date>_h200_<commit>_moe-fp32.json

``--fused-head on`` runs every layout with ``model.fused_head: true`` (log-probs from the hidden
states and the LM head's weight), ``off`` with it false; the default runs the layouts as the
backends declare them (a few fused ones among them).

Needs torch, transformers and the engines of the chosen backends (deepspeed, megatron-core).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.run_environment import run_environment
from tests.contract import clauses, critic, launch
from tests.contract.backends import FUSED_HEAD_MODES, REGISTRY, skip_reason, with_fused_head

logger = logging.getLogger("contract_table")


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None  # JSON has no inf


def summarise(checks: dict[str, list[clauses.Check]]) -> dict[str, Any]:
    """Per clause (1..8): the worst errors over its checks, pass/fail, and the failed checks."""
    out: dict[str, Any] = {}
    for key, items in checks.items():
        clause = key.split(":")[0]
        entry = out.setdefault(
            clause, {"max_abs_err": 0.0, "max_rel_err": 0.0, "ok": True, "checks": 0, "failed": []}
        )
        for c in items:
            entry["checks"] += 1
            entry["max_abs_err"] = max(entry["max_abs_err"], c.max_abs)
            entry["max_rel_err"] = max(entry["max_rel_err"], c.max_rel)
            if not c.ok:
                entry["ok"] = False
                entry["failed"].append(c.describe())
    for entry in out.values():
        entry["max_abs_err"] = _finite(entry["max_abs_err"])
        entry["max_rel_err"] = _finite(entry["max_rel_err"])
        entry["failed"] = entry["failed"][:50]
    return dict(sorted(out.items()))


def logprob_calls(measured: clauses.Measured) -> dict[str, int]:
    """Calls of core's log-prob entry points over the group's ranks, by input: logits / hidden /
    the loss inside the fused head (``head_loss``)."""
    total = {"logits": 0, "hidden": 0, "head_loss": 0}
    for r in measured.ranks:
        for key, n in r.get("logprob_calls", {}).items():
            total[key] += n
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--dtype", choices=tuple(clauses.TOLERANCES), default="bf16")
    parser.add_argument("--out", type=Path, required=True, help="the JSON table to write")
    parser.add_argument("--backends", default=",".join(REGISTRY), help="comma-separated names")
    parser.add_argument("--layouts", default="", help="comma-separated layout names (default: all)")
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a temporary folder")
    parser.add_argument(
        "--fused-head",
        choices=FUSED_HEAD_MODES,
        default="declared",
        help="model.fused_head on every layout (on / off) or as each layout declares it",
    )
    parser.add_argument(
        "--no-critic",
        action="store_true",
        help="skip the critic clauses (tests/contract/critic.py)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device")
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    wanted = {x for x in args.layouts.split(",") if x}
    tol = clauses.TOLERANCES[args.dtype]
    root = args.work_dir or Path(tempfile.mkdtemp(prefix="unirl-contract-"))
    root.mkdir(parents=True, exist_ok=True)

    prepared: dict[str, tuple[Path, list[dict[str, Any]]]] = {}  # per fixture, when first run
    references: dict[str, Any] = {}

    def data_of(fixture: str) -> tuple[Path, list[dict[str, Any]]]:
        if fixture not in prepared:
            prepared[fixture] = launch.prepare(root / fixture, fixture)
        return prepared[fixture]

    def reference_of(fixture: str, measured: clauses.Measured) -> clauses.ReferenceResults:
        """The dense reference (once), or the MoE one for the splits this group ran."""
        if fixture not in references:
            model_dir, records = data_of(fixture)
            make = clauses.MoeReferences if fixture == "moe" else clauses.compute_reference
            references[fixture] = make(model_dir, records)
        ref = references[fixture]
        return ref.for_group(measured) if fixture == "moe" else ref

    critic_ref = None  # computed at the first critic group
    results: dict[str, dict[str, Any]] = {}
    for name in [x for x in args.backends.split(",") if x]:
        entry = REGISTRY[name]
        for declared in entry.layouts:
            layout = with_fused_head(declared, args.fused_head)
            if layout is None or (wanted and layout.name not in wanted):
                continue
            row: dict[str, Any] = {
                "world_size": layout.world_size,
                "parallel": layout.parallel_dict,
                "model": layout.model_dict,
            }
            results.setdefault(name, {})[layout.name] = row
            reason = skip_reason(entry, layout, args.device, gpus)
            if reason:
                row["skipped"] = reason
                logger.info("%s/%s: skipped (%s)", name, layout.name, reason)
                continue
            logger.info("%s/%s: running", name, layout.name)
            model_dir, records = data_of(layout.fixture)
            row["fixture"] = layout.fixture
            try:
                measured = launch.run_group(
                    entry,
                    layout,
                    model_dir=model_dir,
                    records=records,
                    work_dir=root / f"{name}-{layout.name}",
                    device=args.device,
                    dtype=args.dtype,
                )
            except Exception as err:  # a crash or hang of the whole group
                row["error"] = str(err)[-4000:]
                logger.info("%s/%s: the group failed: %s", name, layout.name, str(err)[-500:])
                continue
            row["wall_s"] = round(measured.wall_s, 2)
            row["section_s"] = {k: round(v, 3) for k, v in measured.timings().items()}
            row["harness_errors"] = {k: v[-2000:] for k, v in measured.errors.items()}
            reference = reference_of(layout.fixture, measured)
            row["clauses"] = summarise(clauses.all_checks(measured, reference, records, tol))
            # which of core's log-prob entry points ran (model.fused_head: "hidden")
            row["logprob_calls"] = logprob_calls(measured)
            verdict = {c: ("ok" if e["ok"] else "FAIL") for c, e in row["clauses"].items()}
            logger.info("%s/%s: %.1f s, %s", name, layout.name, measured.wall_s, verdict)
            if entry.supports_critic and not args.no_critic and layout.fixture == "dense":
                # PPO's critic (C1-C5), its own group of processes
                try:
                    mc = critic.run_critic_group(
                        entry,
                        layout,
                        model_dir=model_dir,
                        records=records,
                        work_dir=root / f"{name}-{layout.name}-critic",
                        device=args.device,
                        dtype=args.dtype,
                    )
                except Exception as err:
                    row["critic_error"] = str(err)[-4000:]
                    continue
                if critic_ref is None:
                    critic_ref = critic.compute_critic_reference(model_dir, records)
                row["critic_wall_s"] = round(mc.wall_s, 2)
                row["critic_harness_errors"] = {k: v[-2000:] for k, v in mc.errors.items()}
                row["critic_clauses"] = summarise(
                    critic.grouped(critic.all_critic_checks(mc, critic_ref, records, tol))
                )
                verdict = {
                    c: ("ok" if e["ok"] else "FAIL") for c, e in row["critic_clauses"].items()
                }
                logger.info("%s/%s critic: %.1f s, %s", name, layout.name, mc.wall_s, verdict)

    table = {
        "device": args.device,
        "dtype": args.dtype,
        "fused_head": args.fused_head,
        "tolerance": {"rtol": tol.rtol, "atol": tol.atol},
        "environment": run_environment(("transformers", "deepspeed", "megatron-core")),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(table, indent=2) + "\n")
    logger.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
