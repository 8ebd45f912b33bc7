"""Training throughput of every backend on one model and one packed batch: FSDP2, DeepSpeed
(ZeRO 1 and ZeRO 3) and Megatron side by side, in one run.

    PYTHONPATH=$PWD python benchmarks/backend_throughput.py \\
        --out benchmarks/results/backend_throughput/<date>_h200_<commit>_all-engines.json

The model (Qwen2.5-1.5B's shape, bf16 with fp32 master weights and optimizer state), the rollout
batch (64 samples of 256..4096 tokens, token-budget microbatches of 16k tokens, one optimizer step
per rollout) and the FLOP count are those of `benchmarks/megatron_throughput.py`, imported from
it, so the Megatron row here and that script's measure the same thing. Each engine runs in its own
process (a fresh CUDA context: peak memory is the engine's own, and no engine's global state
leaks into the next), `RLStep.run` with ``old_logprobs: reuse`` (the training pass alone) and,
with ``--modes reuse,recompute``, with a forward-only pass first; ``--fused-head`` sets
``model.fused_head: true`` for every engine. Times are medians of
``--steps`` steps after ``--warmup``; MFU = model FLOPs / (time x 989 TFLOP/s). With
``--profile-dir DIR`` each engine runs one more step per mode under torch.profiler and writes
``DIR/profile_<engine>_<mode>.txt``: the kernel table (by CUDA time) and the CPU table (by CPU
time), as `benchmarks/megatron_throughput.py --profile-dir` does; the profiled step is not timed.

CPU smoke run of the driver (FSDP2 and DeepSpeed only; Megatron's schedules need CUDA)::

    PYTHONPATH=$PWD python benchmarks/backend_throughput.py --device cpu --layers 1 \\
        --hidden 64 --samples 8 --min-len 16 --max-len 64 --tokens-per-microbatch 256 \\
        --steps 1 --warmup 0 --out /tmp/backend_throughput_cpu.json
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.megatron_throughput import (
    MODELS,
    add_lora_argument,
    add_offload_argument,
    add_recompute_arguments,
    config_dict,
    cudnn_attention_state,
    matmul_params,
    memory_plan,
    model_flops,
    model_shape,
    rollout_lengths,
    rollout_records,
    summary,
)
from benchmarks.optimizer_timing import optimizer_steps_timed
from benchmarks.profile_gaps import add_profile_gaps_argument
from benchmarks.run_environment import run_environment
from unirl.backends.deepspeed.engine import deep_merge

logger = logging.getLogger("backend_throughput")

# engine name -> (backend, config sections merged over megatron_throughput's config)
ENGINES: dict[str, tuple[str, dict[str, Any]]] = {
    "fsdp2": ("fsdp2", {"parallel": {"zero_stage": 0}, "fsdp2": {"sharding": "full_shard"}}),
    "deepspeed-zero1": ("deepspeed", {"parallel": {"zero_stage": 1}}),
    "deepspeed-zero3": ("deepspeed", {"parallel": {"zero_stage": 3}}),
    "megatron": ("megatron", {"parallel": {"zero_stage": 1}}),
}
NEEDS_CUDA = {"megatron": "Megatron's pipeline schedules need CUDA"}


def engine_config(args: argparse.Namespace, hf: dict[str, Any], engine: str, mode: str) -> dict:
    backend, sections = ENGINES[engine]
    data = config_dict(args, hf, mode)
    data["backend"] = backend
    data["parallel"] = {"zero_stage": 0}  # one GPU: no tp / pp / cp
    if backend != "megatron":
        del data["megatron"]  # the HF backends always run packed sequences
        data["model"]["liger_kernels"] = args.liger_kernels
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    # A/B knobs from the command line: the engine's own section, merged last
    if backend == "fsdp2" and args.fsdp2_options:
        data["fsdp2"] = {**data.get("fsdp2", {}), **json.loads(args.fsdp2_options)}
    if backend == "deepspeed" and args.deepspeed_extra:
        extra = data.setdefault("deepspeed", {}).get("extra", {})
        data["deepspeed"]["extra"] = deep_merge(extra, json.loads(args.deepspeed_extra))
    return data


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def profile_step(fn: Any, path: Path, device: str, rows: int = 45) -> None:
    """One more call of ``fn`` under torch.profiler: kernel and CPU tables as text in ``path``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        _sync(device)
    table = prof.key_averages()
    text = ""
    if device == "cuda":
        text = table.table(sort_by="cuda_time_total", row_limit=rows) + "\n\n"
    text += table.table(sort_by="cpu_time_total", row_limit=rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    logger.info("wrote %s", path)


def run_engine(args: argparse.Namespace) -> dict[str, Any]:
    """In the child process: build one engine, time its RL steps, report."""
    from unirl.backends import build_backend
    from unirl.core.config.derived import head_path
    from unirl.core.config.run_config import config_from_dict
    from unirl.core.data.rollout import RolloutBatch
    from unirl.core.step import RLStep

    hf = model_shape(args)
    lengths = rollout_lengths(args)
    batch = RolloutBatch.from_records(rollout_records(lengths, hf["vocab_size"], args.group, 0))
    modes = [m for m in args.modes.split(",") if m]
    cfgs = {m: config_from_dict(engine_config(args, hf, args.engine, m)) for m in modes}
    t0 = time.perf_counter()
    backend = build_backend(cfgs[modes[0]], total_optimizer_steps=1000, needs_reference=False)
    out: dict[str, Any] = {"build_s": time.perf_counter() - t0, "results": {}}
    try:
        for mode in modes:
            if args.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            step = RLStep(cfgs[mode], backend)
            times, metrics, optimizer_s = [], [], []
            sync = functools.partial(_sync, args.device)
            with optimizer_steps_timed(backend, sync) as optimizer:
                for i in range(args.warmup + args.steps):
                    sync()
                    t = time.perf_counter()
                    mark = optimizer.mark()
                    result = step.run(batch)
                    sync()
                    if i >= args.warmup:
                        times.append(time.perf_counter() - t)
                        metrics.append(result.metrics)
                        optimizer_s.append(optimizer.since(mark))
            res: dict[str, Any] = {
                "step_s": times,
                "actor_phase_s": [
                    m.get("time/actor_forward_s", 0.0) + m["time/train_s"] for m in metrics
                ],
                "actor_forward_s": [m.get("time/actor_forward_s", 0.0) for m in metrics],
                "train_s": [m["time/train_s"] for m in metrics],
                # the optimizer step alone (offloaded: the host's Adam step and copies)
                "optimizer_s": optimizer_s,
                "old_logprob_source": result.decision.source,
                # with --fused-head: the loss inside the head (3 matmuls) or after it (4)
                "head_path": head_path(cfgs[mode]).reason,
                # `unirl check`'s memory decisions: the head and where the optimizer state lives
                "memory_plan": memory_plan(cfgs[mode]),
                "loss": result.metrics.get("loss"),
                "grad_norm": result.metrics.get("grad_norm"),
            }
            if args.device == "cuda":
                res["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
                # weights + gradients + optimizer state between steps (the peak's rest: the step)
                res["memory_between_steps_gib"] = torch.cuda.memory_allocated() / 2**30
            # the process's peak resident host memory (the whole run on the CPU smoke runs;
            # the offloaded optimizer state on a GPU)
            res["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
            res["summary"] = summary(hf, lengths, res, backend.topology.world_size)
            if args.profile_dir is not None:
                path = args.profile_dir / f"profile_{args.engine}_{mode}.txt"
                profile_step(functools.partial(step.run, batch), path, args.device)
                res["profile"] = str(path)
                if args.profile_gaps and args.device == "cuda":
                    from benchmarks.profile_gaps import profile_with_gaps

                    name = f"{args.engine}_{mode}"
                    profile_with_gaps(
                        functools.partial(step.run, batch),
                        args.profile_dir,
                        name,
                        with_stack=args.profile_gaps == "stack",
                    )
            out["results"][mode] = res
            logger.info("%s %s: %s", args.engine, mode, json.dumps(res["summary"]))
    finally:
        backend.close()
    return out


def _child_command(args: argparse.Namespace, engine: str, out: Path) -> list[str]:
    argv = [a for a in sys.argv[1:]]
    for flag in ("--out", "--engines"):  # the parent's own flags
        if flag in argv:
            i = argv.index(flag)
            del argv[i : i + 2]
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        *argv,
        "--engine",
        engine,
        "--out",
        str(out),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--engine", default=None, help=argparse.SUPPRESS)  # child process
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-1.5b")
    parser.add_argument("--layers", type=int, default=None, help="override (smoke runs)")
    parser.add_argument("--hidden", type=int, default=None, help="override (smoke runs)")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--min-len", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--tokens-per-microbatch", type=int, default=16384)
    parser.add_argument("--recompute-activations", action="store_true")
    add_recompute_arguments(parser)  # the Megatron engine's (the HF engines recompute whole layers)
    add_offload_argument(parser)
    parser.add_argument(
        "--fused-head", action="store_true", help="model.fused_head: log-probs without logits"
    )
    parser.add_argument(
        "--liger-kernels",
        action="store_true",
        help="model.liger_kernels on the HF engines: Liger's RMSNorm / rotary / SwiGLU kernels",
    )
    add_lora_argument(parser)
    parser.add_argument("--modes", default="reuse")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per engine")
    parser.add_argument(
        "--fsdp2-options",
        default="",
        help='JSON merged into the fsdp2 engine\'s fsdp2: section, e.g. \'{"sharding": "shard_grad_op"}\'',
    )
    parser.add_argument(
        "--deepspeed-extra",
        default="",
        help="JSON merged into deepspeed.extra of the DeepSpeed engines, e.g. "
        '\'{"zero_optimization": {"stage3_prefetch_bucket_size": 200000000}}\'',
    )
    parser.add_argument(
        "--profile-dir",
        type=Path,
        default=None,
        help="profile one more step per engine and mode: kernel + CPU tables as text here",
    )
    add_profile_gaps_argument(
        parser, "; two more steps per mode, so a later mode starts from other weights"
    )
    args = parser.parse_args()
    # megatron_throughput.config_dict reads these
    args.attention, args.tp, args.pp, args.vpp, args.cp = "packed", 1, 1, None, 1
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(min(8, os.cpu_count() or 1))

    if args.engine is not None:  # the child: one engine, its JSON to --out
        args.out.write_text(json.dumps(run_engine(args), indent=1) + "\n")
        return

    hf = model_shape(args)
    lengths = rollout_lengths(args)
    report: dict[str, Any] = {
        "environment": {
            **run_environment(("transformers", "megatron-core", "deepspeed")),
            "torch_threads": torch.get_num_threads(),
            "device": args.device,
        },
        "model": {"name": args.model, **hf, "matmul_params": matmul_params(hf)},
        "batch": {
            "samples": len(lengths),
            "tokens": sum(lengths),
            "min_len": min(lengths),
            "max_len": max(lengths),
            "tokens_per_microbatch": args.tokens_per_microbatch,
            "activation_recompute": args.recompute_activations,
            "attention_kept": args.recompute_activations and args.keep_attention,
            "cudnn_attention": cudnn_attention_state(),
            "fused_head": args.fused_head,
            "optimizer_offload": args.optimizer_offload,
            "liger_kernels": args.liger_kernels,
            "fsdp2_options": args.fsdp2_options or None,
            "deepspeed_extra": args.deepspeed_extra or None,
        },
        "flops": {
            "train_pass": model_flops(hf, lengths, training=True),
            "forward_pass": model_flops(hf, lengths, training=False),
        },
        "engines": {},
    }
    # the repository first, then whatever the caller's PYTHONPATH holds (the GPU machine's engine wheels)
    root = str(Path(__file__).resolve().parents[1])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
    }
    for engine in [e for e in args.engines.split(",") if e]:
        if args.device == "cpu" and engine in NEEDS_CUDA:
            report["engines"][engine] = {"skipped": NEEDS_CUDA[engine]}
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "engine.json"
            cmd = _child_command(args, engine, out)
            logger.info("engine %s: %s", engine, " ".join(cmd))
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, env=env, timeout=args.timeout_s, check=False)
            except subprocess.TimeoutExpired:
                report["engines"][engine] = {"failed": f"timed out after {args.timeout_s:.0f} s"}
                continue
            if proc.returncode != 0 or not out.is_file():
                report["engines"][engine] = {"failed": f"exit code {proc.returncode}"}
                continue
            report["engines"][engine] = {
                **json.loads(out.read_text()),
                "wall_s": time.perf_counter() - t0,
            }
    rows = {
        name: {
            "tokens_per_s": r["results"]["reuse"]["summary"].get("train_tokens_per_s"),
            "mfu": r["results"]["reuse"]["summary"].get("train_mfu"),
            "peak_memory_gib": r["results"]["reuse"].get("peak_memory_gib"),
            "optimizer_offload": r["results"]["reuse"]["memory_plan"]["optimizer_offload"],
            "step_s": statistics.median(r["results"]["reuse"]["step_s"]),
        }
        for name, r in report["engines"].items()
        if "results" in r and "reuse" in r["results"]
    }
    report["table"] = rows
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for name, row in rows.items():
        logger.info("%-16s %s", name, json.dumps(row))


if __name__ == "__main__":
    main()
