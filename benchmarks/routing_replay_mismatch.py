"""The train/rollout log-prob mismatch on a tiny Qwen3-MoE with and without routing replay (R3,
``algorithm.routing_replay: rollout`` against ``off``), on the CPU.

    PYTHONPATH=$PWD python benchmarks/routing_replay_mismatch.py \
        [--router-noise 0 0.1] [--bf16-engine] [--rollouts 4] \
        [--out FILE]   (default: a new dated file under benchmarks/results/routing_replay_mismatch/)

What stands in for the engine. vLLM's CPU build cannot return routed experts (README, "Routing
replay"), so the rollouts are written by ``examples/make_moe_rollouts.py``: the trainer's initial
weights with Gaussian noise (``--router-noise`` x the weight's standard deviation) on the router
weights only, an engine whose numerics route some tokens elsewhere; it samples the responses,
its log-probs are the rollout log-probs and its routing the ``routed_experts``. Noise 0 is the
trainer's own model (the mismatch floor: the sampler's KV-cache arithmetic against the
trainer's packed forward). ``--bf16-engine`` adds an engine with the trainer's weights in bf16
(no noise): its routing differs where bf16 rounding flips a near tie, and every other layer's
rounding differs too, which replay cannot remove.

Then ``unirl train examples/tiny_qwen3_moe_replay.yaml`` on that file, once per mode, with the
mismatch metrics on. Step 1 is the clean comparison (the trainer holds the weights the file was
sampled from); later steps are off-policy (the file was sampled by the initial weights), so
their mismatch also holds the policy's drift. Each run is a fresh process (DeepSpeed keeps
process-global state).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.result_files import new_result_path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples/tiny_qwen3_moe_replay.yaml"
KEYS = (
    "train_rollout_logprob_abs_diff",
    "train_rollout_logprob_abs_diff_max",
    "train_rollout_kl",
    "router/disagreement",
)


def _run(args: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{proc.stderr[-3000:]}")


def _train(rollouts: Path, mode: str, run_dir: Path, steps: int) -> list[dict]:
    _run([
        sys.executable, "-m", "unirl.cli", "train", str(CONFIG), "--rollouts", str(rollouts),
        "--set", f"algorithm.routing_replay={mode}", "--set", f"train.rl_steps={steps}",
        "--set", f"logging.run_dir={run_dir}", "--set", "logging.tensorboard=false",
        "--set", "checkpoint.export_hf=false", "--set", "progress.enabled=false",
    ])  # fmt: skip
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{"step": r["step"], **{k: r[k] for k in KEYS if k in r}} for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--router-noise", type=float, nargs="+", default=[0.0, 0.1])
    parser.add_argument("--bf16-engine", action="store_true")
    parser.add_argument("--rollouts", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out",
        default=None,
        help="default: a new dated file under results/routing_replay_mismatch/",
    )
    args = parser.parse_args()
    if args.out is None:
        args.out = str(new_result_path("routing_replay_mismatch", "cpu"))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        engines = [(noise, "fp32") for noise in args.router_noise]
        engines += [(0.0, "bf16")] if args.bf16_engine else []
        for noise, dtype in engines:
            file = Path(tmp) / f"rollouts_noise{noise}_{dtype}.jsonl"
            _run([
                sys.executable, str(ROOT / "examples/make_moe_rollouts.py"), "--out", str(file),
                "--rollouts", str(args.rollouts), "--router-noise", str(noise),
                "--dtype", dtype, "--seed", str(args.seed),
            ])  # fmt: skip
            for mode in ("off", "rollout"):
                start = time.perf_counter()
                run_dir = Path(tmp) / f"run_{noise}_{dtype}_{mode}"
                steps = _train(file, mode, run_dir, args.rollouts)
                results.append({
                    "engine_dtype": dtype, "router_noise": noise, "routing_replay": mode,
                    "step_1": steps[0], "steps": steps,
                    "wall_s": round(time.perf_counter() - start, 1),
                })  # fmt: skip
                print(f"engine {dtype}, router noise {noise}, routing_replay {mode}: {steps[0]}")
    out = {
        "what": (
            "train/rollout log-prob mismatch of the tiny Qwen3-MoE (examples/"
            "tiny_qwen3_moe_replay.yaml: 2 MoE layers, 8 experts, top-2, fp32, DeepSpeed on the "
            "CPU) with routing replay from the rollouts (routing_replay: rollout) and without "
            "(off). The rollouts are NOT from vLLM (its CPU build cannot return routed experts): "
            "a copy of the initial model with Gaussian noise of router_noise x std on its router "
            "weights sampled them and recorded its routing (examples/make_moe_rollouts.py), "
            "standing in for an engine with other numerics; engine_dtype bf16: the initial "
            "weights in bf16, no noise, against the fp32 trainer. step_1 is the clean comparison (the "
            "trainer holds the sampling weights but for the router noise); later steps are "
            "off-policy, the file being sampled by the initial weights."
        ),
        "command": "PYTHONPATH=$PWD python benchmarks/routing_replay_mismatch.py "
        + " ".join(
            ["--router-noise", *map(str, args.router_noise), "--rollouts", str(args.rollouts)]
        )
        + (" --bf16-engine" if args.bf16_engine else ""),
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, shared with other jobs "
        "(wall times are not speed measurements)",
        "results": results,
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
