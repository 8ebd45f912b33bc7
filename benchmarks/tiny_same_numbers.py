"""The tiny example computes what it computed before the CPU speed work: same rollouts, same losses.

    PYTHONPATH=$PWD python benchmarks/tiny_same_numbers.py [--steps 20]

Runs ``examples/tiny_grpo.yaml`` (as ``unirl train`` does, ``train.rl_steps=--steps``) and
compares its ``metrics.jsonl`` with ``results/tiny_grpo/2026-11-30_cpu_d50dc2c_metrics.jsonl``,
written by the code before the CPU speed-up (commit d50dc2c, the same command). Step 1's
rollout is the seeded sampler's on the initial weights, so every metric of step 1 must agree:
the loss terms, entropy and gradient norm to 1e-6, the rollout's rewards and lengths exactly.
Later steps sample from weights that went through float sums in another order (attention per
bucket instead of per sequence), so a sampled token may flip after some steps; the script prints
the first step whose rollout differs and the largest loss difference before it. Exits 1 when
step 1 disagrees.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEFORE = ROOT / "benchmarks/results/tiny_grpo/2026-11-30_cpu_d50dc2c_metrics.jsonl"
TOLERANCE = 1e-6
ROLLOUT_KEYS = ("reward/mean", "reward/std", "response_length/mean", "response_length/max")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    from unirl.core.config.run_config import load_config
    from unirl.train import train

    before = [json.loads(line) for line in BEFORE.read_text().splitlines()][: args.steps]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            ROOT / "examples/tiny_grpo.yaml",
            [f"train.rl_steps={len(before)}", f"logging.run_dir={tmp}/run",
             "checkpoint.export_hf=false", "progress.enabled=false"],
        )  # fmt: skip
        train(cfg)
        now = [
            json.loads(line) for line in Path(f"{tmp}/run/metrics.jsonl").read_text().splitlines()
        ]
    numeric = [k for k, v in before[0].items() if isinstance(v, float) and k not in ROLLOUT_KEYS]
    diffs = {k: abs(now[0][k] - before[0][k]) for k in numeric}
    worst = max(diffs, key=diffs.get)
    same_rollout = all(now[0][k] == before[0][k] for k in ROLLOUT_KEYS)
    print(f"step 1: same rollout: {same_rollout}; largest difference {diffs[worst]:.3g} ({worst})")
    first_other = next(
        (a["step"] for a, b in zip(now, before) if any(a[k] != b[k] for k in ROLLOUT_KEYS)), None
    )
    until = len(before) if first_other is None else first_other - 1
    loss_diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(now[:until], before[:until]))
    print(
        f"steps 1-{until} have the same rollouts (largest loss difference {loss_diff:.3g}); "
        + ("all steps compared" if first_other is None else f"step {first_other} differs")
    )
    print("rewards before:", [round(b["reward/mean"], 4) for b in before])
    print("rewards now:   ", [round(a["reward/mean"], 4) for a in now])
    if not same_rollout or diffs[worst] > TOLERANCE:
        sys.exit(1)


if __name__ == "__main__":
    main()
