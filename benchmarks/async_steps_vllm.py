"""Seconds per RL step for train.max_staleness k = 0, 1, 2 with vLLM generating on the CPU
(``examples/tiny_grpo_vllm.yaml``, DeepSpeed training), and for a larger model of the same shape
family where generation and training take similar time; all six runs back to back in this one
process (``unirl.train.train`` called per run, each with its own engine).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/async_steps_vllm.py [--steps 10]

Per step, inside each run: the wall time between consecutive lines of ``metrics.jsonl`` (a
watcher thread notes when each appears), G (``time/generation_s``: for k > 0 the worker's
generation, measured in the worker), T (``time/step_s``: the RL step), the bound a perfect
overlap can reach, max(G, T), and the trainer's wait for its rollout. The first two steps are
left out (step 1 has nothing generated ahead; step 2 still overlaps the engine's first reload).
Threads per phase: the trainer's torch intra-op threads, and the engine's processes (their most
threads seen, and the CPU seconds the trainer process and the engine processes each used during
the run). Writes a new dated file under
``benchmarks/results/async_steps_vllm/`` (``benchmarks/result_files.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.result_files import new_result_path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples/tiny_grpo_vllm.yaml"
MODELS = {
    "tiny (examples/tiny_grpo_vllm.yaml)": [],
    # 4x wider, 2x deeper: training grows with the parameters, generation on the CPU much less
    "larger (hidden 512, 4 layers)": [
        "model.hf_config.hidden_size=512",
        "model.hf_config.intermediate_size=1024",
        "model.hf_config.num_hidden_layers=4",
        "model.hf_config.num_attention_heads=8",
        "model.hf_config.num_key_value_heads=4",
    ],
}
SKIP = 2


class LineTimes(threading.Thread):
    """When each line of a growing file appeared (polled every 10 ms)."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path, self.times, self.stop = path, [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            if self.path.exists():
                n = self.path.read_bytes().count(b"\n")
                self.times += [time.perf_counter()] * (n - len(self.times))
            time.sleep(0.01)


class EngineProcesses(threading.Thread):
    """The most threads seen in this process's children (the engine), and their CPU seconds."""

    def __init__(self) -> None:
        import psutil

        super().__init__(daemon=True)
        self.me, self.stop = psutil.Process(), threading.Event()
        self.threads: dict[str, int] = {}
        self.cpu_s: dict[int, float] = {}

    def run(self) -> None:
        while not self.stop.is_set():
            for child in self.me.children(recursive=True):
                try:
                    name = child.name()
                    self.threads[name] = max(self.threads.get(name, 0), child.num_threads())
                    t = child.cpu_times()
                    self.cpu_s[child.pid] = t.user + t.system
                except Exception:  # gone between listing and reading
                    continue
            time.sleep(0.5)


def _run(tmp: Path, name: str, sets: list[str], k: int, steps: int) -> dict:
    import psutil
    import torch

    from unirl.core.config.run_config import load_config
    from unirl.train import train

    run_dir = tmp / name
    overrides = [
        *sets,
        f"train.rl_steps={steps}",
        f"train.max_staleness={k}",
        f"algorithm.decoupled={'true' if k else 'false'}",
        f"logging.run_dir={run_dir}",
        "logging.tensorboard=false",
        "checkpoint.export_hf=false",
        "checkpoint.every=0",
        "progress.enabled=false",
    ]
    cfg = load_config(CONFIG, overrides)
    lines, engine = LineTimes(run_dir / "metrics.jsonl"), EngineProcesses()
    lines.start()
    engine.start()
    me = psutil.Process()
    cpu0, t0 = me.cpu_times(), time.perf_counter()
    train(cfg)
    wall = time.perf_counter() - t0
    cpu1 = me.cpu_times()
    time.sleep(0.05)
    lines.stop.set()
    engine.stop.set()
    lines.join()
    engine.join()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kept = rows[SKIP:]
    step_wall = [b - a for a, b in zip(lines.times[SKIP - 1 :], lines.times[SKIP:])]
    g = statistics.mean(r["time/generation_s"] for r in kept)
    t = statistics.mean(r["time/step_s"] for r in kept)
    entry = {
        "seconds_per_step": statistics.mean(step_wall),
        "generation_s_G": g,
        "train_step_s_T": t,
        "limit_max_G_T": max(g, t),
        "weight_sync_s": statistics.mean(r["time/weight_sync_s"] for r in kept),
        "steps_measured": len(step_wall),
        "run_wall_s": wall,
        "reward_mean_last": rows[-1]["reward/mean"],
        "threads": {
            "trainer_torch_intra_op": torch.get_num_threads(),
            "engine_processes_max_threads": engine.threads,
            "trainer_process_cpu_s": (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system),
            "engine_processes_cpu_s": sum(engine.cpu_s.values()),
        },
    }
    if k:
        entry["rollout_wait_s"] = statistics.mean(r["time/rollout_wait_s"] for r in kept)
        entry["overlap_s"] = statistics.mean(r["time/overlap_s"] for r in kept)
        entry["staleness_mean"] = statistics.mean(r["rollout/staleness_mean"] for r in kept)
    entry["vs_limit"] = entry["seconds_per_step"] / entry["limit_max_G_T"]
    return entry


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    # Named before the run, so that a checkout without git fails before the work, not after.
    out = new_result_path("async_steps_vllm", "cpu")
    from unirl.cpu_threads import apply_cpu_thread_defaults

    apply_cpu_thread_defaults()  # what the `unirl` command does before torch loads
    result: dict = {
        "command": "PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/async_steps_vllm.py "
        + " ".join(sys.argv[1:]),
        "machine": f"{os.cpu_count()} CPU cores, shared with other jobs (load varies during "
        "the runs: compare k within one model, not with other files)",
        "env": {
            name: os.environ.get(name)
            for name in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")
        },
        "note": "trainer (main thread), rollout worker (a thread of the trainer process driving "
        "the engine) and the vLLM engine's processes share the same cores",
        "models": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for m, (model, sets) in enumerate(MODELS.items()):
            runs: dict = {}
            for k in (0, 1, 2):
                runs[f"k={k}"] = _run(Path(tmp), f"m{m}k{k}", sets, k, args.steps)
                print(model, f"k={k}", json.dumps(runs[f"k={k}"]), flush=True)
            base = runs["k=0"]["seconds_per_step"]
            for k in (1, 2):
                runs[f"k={k}"]["speedup_over_k0"] = base / runs[f"k={k}"]["seconds_per_step"]
            result["models"][model] = runs
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":  # vLLM spawns its processes: they re-import this script
    main()
