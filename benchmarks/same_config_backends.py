"""Same config, other backend: run one config on several backends from the same seed and put
their reward curves side by side (JSON + PNG).

    PYTHONPATH=$PWD python benchmarks/same_config_backends.py \
        --config examples/tiny_grpo.yaml --backends deepspeed megatron \
        --out-dir runs/same_config

Each backend runs `unirl train` in its own process (`torchrun --nproc_per_node N` for megatron, on
GPUs or on the CPU); extra `--set key=value` overrides apply to every run. The JSON holds
the per-step reward, loss and grad norm of each backend, the exact commands, and the largest
per-step reward difference; the PNG overlays the reward curves.
Keep a run's JSON and PNG as ``benchmarks/results/same_config_backends/<date>_<hardware>_<commit>.{json,png}``
(the layout of ``benchmarks/result_files.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _command(backend: str, config: str, run_dir: Path, sets: list[str], nproc: int) -> list[str]:
    overrides = [f"backend={backend}", f"logging.run_dir={run_dir}", "logging.tensorboard=false"]
    overrides += sets
    args = ["train", config, *[x for o in overrides for x in ("--set", o)]]
    if backend == "megatron" or nproc > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        return [*launcher, f"--nproc_per_node={nproc}", "-m", "unirl.cli", *args]
    return [sys.executable, "-m", "unirl.cli", *args]


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _plot(curves: dict[str, list[dict[str, Any]]], out: Path) -> None:
    try:
        import matplotlib
    except ImportError:  # the GPU machine has none: `--replot JSON` draws it elsewhere
        print("matplotlib is not installed: no PNG (run again with --replot JSON)", flush=True)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for backend, rows in curves.items():
        ax.plot([r["step"] for r in rows], [r["reward/mean"] for r in rows], label=backend)
    ax.set_xlabel("RL step")
    ax.set_ylabel("reward (mean)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="examples/tiny_grpo.yaml")
    parser.add_argument("--backends", nargs="+", default=["deepspeed", "megatron"])
    parser.add_argument("--nproc", type=int, default=1, help="processes per run")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out-dir", default="runs/same_config")
    parser.add_argument("--replot", type=Path, default=None, help="draw the PNG of a JSON")
    args = parser.parse_args()
    if args.replot is not None:
        runs = json.loads(args.replot.read_text())["runs"]
        curves = {name: run["steps"] for name, run in runs.items() if "steps" in run}
        _plot(curves, args.replot.with_suffix(".png"))
        return
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    report: dict[str, Any] = {"command": " ".join(sys.argv), "config": args.config, "runs": {}}
    curves = {}
    for backend in args.backends:
        run_dir = out_dir / f"run_{backend}"
        cmd = _command(backend, args.config, run_dir, args.set, args.nproc)
        t0 = time.perf_counter()
        run_dir.mkdir(parents=True, exist_ok=True)
        log = run_dir / "train.log"  # written as the run goes (progress lines)
        with log.open("w") as sink:
            proc = subprocess.run(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True)
        wall = time.perf_counter() - t0
        entry: dict[str, Any] = {
            "command": " ".join(cmd),
            "returncode": proc.returncode,
            "wall_s": wall,
        }
        if proc.returncode != 0:
            entry["log_tail"] = log.read_text()[-4000:]
        else:
            rows = _metrics(run_dir)
            curves[backend] = rows
            entry["steps"] = [
                {k: r.get(k) for k in ("step", "reward/mean", "loss", "grad_norm", "entropy")}
                for r in rows
            ]
        report["runs"][backend] = entry
        print(f"{backend}: rc={proc.returncode} in {wall:.1f} s", flush=True)
    if len(curves) >= 2:
        names = list(curves)
        a, b = curves[names[0]], curves[names[1]]
        report["max_reward_diff"] = max(
            abs(x["reward/mean"] - y["reward/mean"]) for x, y in zip(a, b)
        )
    (out_dir / "same_config.json").write_text(json.dumps(report, indent=2))
    if curves:
        _plot(curves, out_dir / "same_config.png")
    print(json.dumps({k: v.get("returncode") for k, v in report["runs"].items()}))


if __name__ == "__main__":
    main()
