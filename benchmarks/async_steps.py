"""Seconds per RL step for train.max_staleness k = 0, 1, 2 on the tiny example (built-in sampler,
DeepSpeed on the CPU), and the steps k = 1 takes to reach reward 0.9.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/async_steps.py [--steps 30] [--reach 400]

Each k runs ``examples/tiny_grpo.yaml`` in its own process, back to back. Per step, the trainer's
loop time is what it waits for its rollout (k = 0: the whole generation) plus the RL step plus
the weight sync; G (generation seconds, measured in the worker for k > 0) and T (the RL step's
seconds) give the limit a perfect overlap could reach, max(G, T). Step 1 is left out (no rollout
was generated ahead of it). ``--reach N`` then trains k = 1 with ``algorithm.decoupled: true``
for up to N steps and records the first step whose mean reward is >= 0.9. Writes a new dated
file under ``benchmarks/results/async_steps/`` (``benchmarks/result_files.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.result_files import new_result_path

ROOT = Path(__file__).resolve().parents[1]


def _train(run_dir: Path, sets: list[str]) -> list[dict]:
    args = [sys.executable, "-m", "unirl.cli", "train", str(ROOT / "examples/tiny_grpo.yaml"),
            "--set", f"logging.run_dir={run_dir}", "--set", "logging.tensorboard=false",
            "--set", "checkpoint.export_hf=false", "--set", "checkpoint.every=0",
            "--set", "progress.enabled=false"]  # fmt: skip
    for s in sets:
        args += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(args, check=True, env=env, capture_output=True, cwd=ROOT)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _loop_s(m: dict, k: int) -> float:
    wait = m["time/rollout_wait_s"] if k else m["time/generation_s"]
    return wait + m["time/step_s"] + m["time/weight_sync_s"] * (k == 0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--reach", type=int, default=400)
    args = parser.parse_args()
    # Named before the run, so that a checkout without git fails before the work, not after.
    out = new_result_path("async_steps", "cpu")
    result: dict = {
        "config": "examples/tiny_grpo.yaml",
        "threads": {
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "cpu_count": os.cpu_count(),
            "note": "trainer and generation worker are two threads of one process on shared cores",
        },
        "speed": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for k in (0, 1, 2):
            t0 = time.perf_counter()
            rows = _train(Path(tmp) / f"k{k}", [f"train.rl_steps={args.steps}",
                                                f"train.max_staleness={k}"])[1:]  # fmt: skip
            loop = [_loop_s(m, k) for m in rows]
            gen = statistics.mean(m["time/generation_s"] for m in rows)
            step = statistics.mean(m["time/step_s"] for m in rows)
            entry = {
                "seconds_per_step": statistics.mean(loop),
                "generation_s_G": gen,
                "train_step_s_T": step,
                "limit_max_G_T": max(gen, step),
                "process_wall_s": time.perf_counter() - t0,
            }
            if k:
                entry["rollout_wait_s"] = statistics.mean(m["time/rollout_wait_s"] for m in rows)
                entry["overlap_s"] = statistics.mean(m["time/overlap_s"] for m in rows)
                entry["staleness_mean"] = statistics.mean(m["rollout/staleness_mean"] for m in rows)
            result["speed"][f"k={k}"] = entry
            print(f"k={k}: {json.dumps(entry)}", flush=True)
        base = result["speed"]["k=0"]["seconds_per_step"]
        for k in (1, 2):
            e = result["speed"][f"k={k}"]
            e["speedup_over_k0"] = base / e["seconds_per_step"]
            e["vs_limit"] = e["seconds_per_step"] / e["limit_max_G_T"]
        if args.reach:
            rows = _train(Path(tmp) / "reach", [f"train.rl_steps={args.reach}",
                                                "train.max_staleness=1",
                                                "algorithm.decoupled=true"])  # fmt: skip
            first = next((m["step"] for m in rows if m["reward/mean"] >= 0.9), None)
            result["reach_0.9"] = {
                "k=1_decoupled_first_step": first,
                "k=1_steps_run": len(rows),
                "k=1_last10_reward_mean": statistics.mean(m["reward/mean"] for m in rows[-10:]),
                "k=0_first_step": 273,
                "k=0_source": "README 'Try it' (benchmarks/results/tiny_grpo/2026-12-01_cpu_47a8197_metrics.jsonl)",
            }
            print(json.dumps(result["reach_0.9"]), flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
