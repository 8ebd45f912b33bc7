"""CPU thread settings of the tiny example, alone and beside one busy process.

    PYTHONPATH=$PWD python benchmarks/cpu_threads.py [--steps 15] [--settings default,passive,...]

For each setting, runs ``unirl train examples/tiny_grpo.yaml`` for a few RL steps twice, back to
back: alone, then beside one process that spins a core (``while True: pass``), and prints the
mean ``time/step_s`` over the steps after the first two (warm-up). A setting is a set of
environment variables given to the training process; ``UNIRL_CPU_THREADS=off`` turns unirl's
own defaults off so that the library's former behaviour can be measured. Timings on a shared
machine are noisy: compare the ratio beside/alone within one invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {
    "torch-default": {"UNIRL_CPU_THREADS": "off"},
    "passive-wait": {"UNIRL_CPU_THREADS": "off", "OMP_WAIT_POLICY": "PASSIVE"},
    "one-thread": {"UNIRL_CPU_THREADS": "off", "OMP_NUM_THREADS": "1"},
    "unirl-default": {},
}


def step_time(env: dict[str, str], steps: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "unirl.cli", "train", str(ROOT / "examples/tiny_grpo.yaml"),
               "--set", f"logging.run_dir={tmp}/run", "--set", f"train.rl_steps={steps}",
               "--set", "logging.tensorboard=false", "--set", "checkpoint.export_hf=false",
               "--set", "progress.enabled=false"]  # fmt: skip
        full_env = {
            k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")
        }
        subprocess.run(cmd, env={**full_env, **env}, check=True, capture_output=True)
        lines = Path(f"{tmp}/run/metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    times = [r["time/step_s"] for r in rows[2:]]
    return sum(times) / len(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    args = parser.parse_args()
    for name in args.settings.split(","):
        env = SETTINGS[name]
        alone = step_time(env, args.steps)
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            beside = step_time(env, args.steps)
        finally:
            busy.kill()
            busy.wait()
        print(f"{name:14s} alone {alone:.3f} s/step, beside a busy process {beside:.3f} s/step "
              f"({beside / alone:.2f}x)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
