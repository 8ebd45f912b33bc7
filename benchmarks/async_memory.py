"""Host memory of asynchronous generation: the peak resident memory of each trainer rank for
``train.max_staleness`` k = 0, 1, 2 on the same job, for this checkout and, with ``--before
DIR``, for another checkout (the code before a change) in the same invocation.

    PYTHONPATH=$PWD python benchmarks/async_memory.py [--before /path/to/old/checkout] \\
        [--ranks 2] [--steps 4] [--out FILE]

The job is ``examples/tiny_grpo.yaml`` with a wider model (hidden 768, 8 layers, 44M parameters,
176 MB in fp32), so that a copy of the weights shows in the resident memory; each rank's peak is
sampled every 50 ms from /proc (psutil) over the whole run. What a copy costs is the difference
from k = 0, per rank: the async wrapper keeps the sync's buckets (the weights the rollouts ahead
are generated from) and, before the change measured here, a clone per queued rollout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from benchmarks.result_files import ROOT, new_result_path

WIDE = [
    "model.hf_config.hidden_size=768", "model.hf_config.intermediate_size=2048",
    "model.hf_config.num_hidden_layers=8", "model.hf_config.num_attention_heads=12",
    "model.hf_config.num_key_value_heads=4",
]  # fmt: skip


def _peaks(proc: subprocess.Popen, ranks: int) -> dict[int, int]:
    """Per rank (its RANK environment variable), the peak RSS of its process in bytes."""
    peaks: dict[int, int] = {}
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            family = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for p in family:
            try:
                env = p.environ()
                if "RANK" not in env and ranks > 1:
                    continue
                rank = int(env.get("RANK", "0"))
                if ranks > 1 or p.pid == root.pid:
                    peaks[rank] = max(peaks.get(rank, 0), p.memory_info().rss)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        time.sleep(0.05)
    return peaks


def run(checkout: Path, k: int, ranks: int, steps: int, work: Path) -> dict[str, object]:
    run_dir = work / f"{checkout.name}_k{k}"
    sets = [*WIDE, f"train.max_staleness={k}", f"train.rl_steps={steps}",
            f"logging.run_dir={run_dir}", "logging.tensorboard=false", "checkpoint.every=0",
            "checkpoint.export_hf=false", "batch.prompts_per_rollout=4",
            "batch.samples_per_optimizer_step=32", "batch.micro_batch_size=8"]  # fmt: skip
    args = [x for s in sets for x in ("--set", s)]
    entry = ["-m", "unirl.cli", "train", str(checkout / "examples/tiny_grpo.yaml"), *args]
    if ranks > 1:
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks)]
    else:
        launch = [sys.executable]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    t0 = time.monotonic()
    proc = subprocess.Popen([*launch, *entry], cwd=checkout, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    box: dict[str, dict[int, int]] = {}
    watcher = threading.Thread(target=lambda: box.update(peaks=_peaks(proc, ranks)))
    watcher.start()
    _, err = proc.communicate()
    watcher.join()
    if proc.returncode != 0:
        raise SystemExit(f"{checkout} k={k} failed:\n{err[-3000:]}")
    peaks = box["peaks"]
    return {
        "k": k,
        "peak_rss_mb_per_rank": {str(r): round(v / 2**20, 1) for r, v in sorted(peaks.items())},
        "wall_s": round(time.monotonic() - t0, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", type=Path, default=None, help="another checkout to compare")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or new_result_path("async_memory", "cpu")
    checkouts = {"this": ROOT, **({"before": args.before.resolve()} if args.before else {})}
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, checkout in checkouts.items():
            rows[name] = [run(checkout, k, args.ranks, args.steps, Path(tmp)) for k in (0, 1, 2)]
            for row in rows[name]:
                print(name, json.dumps(row), flush=True)
    command = "PYTHONPATH=$PWD python benchmarks/async_memory.py " + " ".join(sys.argv[1:])
    result = {
        "command": command,
        "machine": "cpu (2 cores, shared)",
        "model": "tiny_grpo.yaml with " + ", ".join(WIDE),
        "ranks": args.ranks,
        "steps": args.steps,
        "runs": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(out)


if __name__ == "__main__":
    main()
