"""The longest sequence that fits: one throughput run per length, each in its own process under its
own timeout, shortest first, stopping at the first that does not run (out of memory, a crash or
its timeout); the JSON names the largest that ran with its MFU, peak memory and memory plan.

    PYTHONPATH=$PWD python benchmarks/longest_sequence.py --lengths 98304,131072,196608 \\
        --timeout-s 200 --budget-s 420 --out /tmp/out/m4b-longest.json -- \\
        python benchmarks/megatron_throughput.py --model qwen3-4b --modes reuse \\
        --recompute-activations --optimizer-offload cpu --steps 1 --warmup 0

Everything after ``--`` is the child command (`benchmarks/megatron_throughput.py` or
`benchmarks/backend_throughput.py`); each try appends one sequence of the length as the whole
batch (``--samples 1 --group 1 --min-len L --max-len L --tokens-per-microbatch L``) and its own
``--out``. A try's limit is the smaller of ``--timeout-s`` and what is left of ``--budget-s``
(the whole search's, so that it fits one GPU-machine call); a try whose limit would be under
``--min-try-s`` is not started. Each child runs in its own process group, ended whole on its
timeout (backend_throughput's engine runs in a grandchild). Its result counts when its JSON
holds a measured step (``results`` or ``table``), as benchmarks/long_sequences.sh counts a row.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.run_environment import run_environment

logger = logging.getLogger("longest_sequence")

OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory")


def measured(report: dict[str, Any]) -> dict[str, Any] | None:
    """The measured run of a child's JSON (megatron_throughput: ``results.reuse``;
    backend_throughput: its one engine's ``results.reuse``), or None."""
    if report.get("results", {}).get("reuse"):
        return {"memory_plan": report.get("memory_plan"), **report["results"]["reuse"]}
    for engine in report.get("engines", {}).values():
        if engine.get("results", {}).get("reuse"):
            return engine["results"]["reuse"]
    return None


def run_try(command: list[str], length: int, limit_s: float, tmp: Path) -> dict[str, Any]:
    """One length in its own process group; what it measured, or why it did not run."""
    out = tmp / f"len{length}.json"
    argv = [*command, "--samples", "1", "--group", "1", "--min-len", str(length)]
    argv += ["--max-len", str(length), "--tokens-per-microbatch", str(length), "--out", str(out)]
    start = time.perf_counter()
    with open(tmp / f"len{length}.log", "w+") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the child and any engine process it started
            proc.wait()
            rc = None
        log.seek(0)
        tail = log.read().splitlines()[-8:]
    row: dict[str, Any] = {"len": length, "wall_s": time.perf_counter() - start, "exit": rc}
    result = measured(json.loads(out.read_text())) if rc == 0 and out.is_file() else None
    if result is None:
        oom = any(m in line for line in tail for m in OOM_MARKERS)
        row["fits"] = False
        row["why"] = (
            f"timed out after {limit_s:.0f} s"
            if rc is None
            else "out of memory"
            if oom
            else f"exit code {rc}"
        )
        row["log_tail"] = [line[:300] for line in tail]
        return row
    summary = result.get("summary", {})
    row |= {
        "fits": True,
        "train_mfu": summary.get("train_mfu"),
        "train_tokens_per_s": summary.get("train_tokens_per_s"),
        "step_s": result.get("step_s"),
        "peak_memory_gib": result.get("peak_memory_gib"),
        "memory_between_steps_gib": result.get("memory_between_steps_gib"),
        "peak_host_rss_gib": result.get("peak_host_rss_gib", result.get("peak_rss_gib")),
        "memory_plan": result.get("memory_plan"),
    }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", required=True, help="comma-separated, tried shortest first")
    parser.add_argument("--timeout-s", type=float, default=240.0, help="per length")
    parser.add_argument("--budget-s", type=float, default=540.0, help="the whole search")
    parser.add_argument("--min-try-s", type=float, default=60.0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the child command")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the child command after --")
    lengths = sorted(int(x) for x in args.lengths.split(",") if x)
    report: dict[str, Any] = {
        "environment": run_environment(),
        "command": command,
        "lengths": lengths,
        "tries": [],
    }
    deadline = time.perf_counter() + args.budget_s
    with tempfile.TemporaryDirectory() as tmp:
        for length in lengths:
            limit = min(args.timeout_s, deadline - time.perf_counter())
            if limit < args.min_try_s:
                report["tries"].append({"len": length, "fits": None, "why": "search budget spent"})
                break
            row = run_try(command, length, limit, Path(tmp))
            report["tries"].append(row)
            logger.info("%d tokens: %s", length, "fits" if row["fits"] else row["why"])
            if not row["fits"]:
                break
    ran = [row for row in report["tries"] if row.get("fits")]
    report["largest_fitting_len"] = ran[-1]["len"] if ran else None
    report["largest"] = ran[-1] if ran else None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    logger.info("largest that ran: %s", report["largest_fitting_len"])
    sys.exit(0)


if __name__ == "__main__":
    main()
