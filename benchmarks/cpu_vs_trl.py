"""unirl against TRL's GRPOTrainer on the CPU, the same GRPO job side by side, in one invocation.

    PYTHONPATH=$PWD python benchmarks/cpu_vs_trl.py                       # both workloads
    PYTHONPATH=$PWD python benchmarks/cpu_vs_trl.py --workloads tiny --steps 60 --pairs 2

Each run is a fresh process (same thread count for both trainers), run in alternating pairs
(unirl then TRL, then TRL then unirl, ...), so a change in machine load hits both sides alike.
unirl runs its real ``unirl.train.train`` (DeepSpeed ZeRO-0, one process); TRL runs
``trl.GRPOTrainer``. Both start from the same weights (unirl's ``build_task_model`` of the
example's model config), see the same prompts in the same order (unirl's task stream with the
same seed; TRL's dataset unshuffled), score with the same reward (``task.reward``), and use the
same token ids (a word-level Hugging Face tokenizer over unirl's ``CharTokenizer`` ids).

Per run: the median seconds per RL step over the steps after ``--warmup``, split into generation
(unirl: ``next_rollout``, i.e. sampling and reward; TRL: ``_generate_and_score_completions``,
i.e. sampling, reward and advantages) and the rest (the training phase, weight sync, logging),
and the mean reward of every step. The ratio is unirl / TRL of the median step time, per pair;
the target is judged on the median over pairs (also stored: the ratio of the pooled medians). Results go to a new dated file under ``benchmarks/results/cpu_vs_trl/`` (``--out``) with
every setting that could not be matched.

Workloads: ``tiny`` is ``examples/tiny_grpo.yaml`` (reverse 2-3 digits, at most 8 new tokens);
``long`` is the same model and algorithm on ``repeat_digit`` (answers of 11-251 tokens, up to 256
new tokens) with a 64-id vocabulary, so that an untrained policy's responses run from a few
tokens to the cap (``<eos>`` is 1 of 64 ids) and packing has padding to save.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.result_files import new_result_path

ROOT = Path(__file__).resolve().parents[1]
RESULT_PREFIX = "CPU_VS_TRL_RESULT "

WORKLOADS: dict[str, dict[str, Any]] = {
    "tiny": {
        "config": "examples/tiny_grpo.yaml",
        "overrides": {},
        "warmup": 10,
        "steps": 100,
        "target_ratio": 0.8,
    },
    "long": {
        "config": "examples/tiny_grpo.yaml",
        "overrides": {
            "rollout.task": "repeat_digit",
            "rollout.task_options": {"min_count": 10, "max_count": 250},
            "rollout.max_new_tokens": 256,
            "model.hf_config.vocab_size": 64,
            "model.hf_config.max_position_embeddings": 320,
            "model.max_seq_len": 320,
        },
        "warmup": 2,
        "steps": 8,
        "target_ratio": 0.6,
    },
}

# What the two sides do differently (nothing else differs; see the module docstring).
UNMATCHED = [
    "generation engine: unirl's built-in sampler (KV cache, rows of one prompt length, stops "
    "when every row has <eos>) vs transformers' generate (left-padded prompts, stops when every "
    "row has <eos>); the sampled tokens differ, so rewards match in distribution, not per step",
    "advantage epsilon: unirl divides by (group std + 1e-6), TRL by (group std + 1e-4)",
    "training layout: unirl packs the sequences of a microbatch into one stream (no padding); "
    "TRL pads prompts on the left and completions on the right to the batch's longest",
    "engine: unirl trains through DeepSpeed ZeRO-0 (fp32), TRL through accelerate without "
    "DeepSpeed (fp32)",
    "unirl checks the policy weights are finite after every step and copies them to its "
    "sampler; TRL generates with the trained module itself",
]


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    *path, last = dotted.split(".")
    node = data
    for key in path:
        node = node.setdefault(key, {})
    node[last] = value


def workload_config(name: str, steps: int, run_dir: str) -> dict[str, Any]:
    import yaml

    spec = WORKLOADS[name]
    data = yaml.safe_load((ROOT / spec["config"]).read_text())
    for key, value in spec["overrides"].items():
        _set(data, key, copy.deepcopy(value))
    _set(data, "train.rl_steps", steps)
    _set(data, "logging.run_dir", run_dir)
    _set(data, "logging.tensorboard", False)
    _set(data, "checkpoint.export_hf", False)
    _set(data, "progress.enabled", False)
    return data


# -- the two children ---------------------------------------------------------------------


def run_unirl(data: dict[str, Any]) -> dict[str, Any]:
    import unirl.rollouts
    from unirl.core.config.run_config import config_from_dict
    from unirl.train import train

    starts: list[float] = []
    gen: list[float] = []
    build = unirl.rollouts.build_rollout_source

    class Timed:
        """The sampler source, with each ``next_rollout`` timed (a step runs from one call's
        start to the next's)."""

        def __init__(self, inner: Any) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

        def next_rollout(self, rl_step: int, progress: Any = None) -> Any:
            starts.append(time.perf_counter())
            batch = self._inner.next_rollout(rl_step, progress=progress)
            gen.append(time.perf_counter() - starts[-1])
            return batch

    unirl.rollouts.build_rollout_source = lambda cfg, **kw: Timed(build(cfg, **kw))
    train(config_from_dict(data), overwrite=True)
    lines = (Path(data["logging"]["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    metrics = [json.loads(line) for line in lines]
    steps = [b - a for a, b in itertools.pairwise(starts)]  # the last step has no successor
    return {
        "first_step": 0,
        "step_s": steps,
        "generation_s": gen[: len(steps)],
        "reward": [m["reward/mean"] for m in metrics],
        "response_length": [m["response_length/mean"] for m in metrics],
    }


def _hf_tokenizer(task: Any, vocab_size: int) -> Any:
    """A word-level tokenizer with unirl's ids: ``<pad> <bos> <eos> <sep>``, the alphabet, then
    filler words up to the model's vocabulary (so every id a policy samples decodes)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from unirl.rollouts.data.tokenizer import SPECIAL_TOKENS

    words = [*SPECIAL_TOKENS, *task.tokenizer.alphabet]
    words += [f"<x{i}>" for i in range(len(words), vocab_size)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[-1]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
    )


def run_trl(data: dict[str, Any], seed_out: str) -> dict[str, Any]:
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(var, "1")
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from unirl.core.config.run_config import config_from_dict
    from unirl.rollouts.data.tasks import Problem, make_task
    from unirl.rollouts.model import build_task_model

    cfg = config_from_dict(data)
    task = make_task(cfg.rollout.task, cfg.rollout.task_options)
    model = build_task_model(cfg.model, task.tokenizer)  # the weights unirl starts from
    tokenizer = _hf_tokenizer(task, model.config.vocab_size)
    b, steps = cfg.batch, cfg.train.rl_steps
    rng = random.Random(cfg.train.seed)  # unirl's prompt stream: same seed, same order
    problems = [task.sample_problem(rng) for _ in range(b.prompts_per_rollout * steps)]
    names = ["<pad>", "<bos>", "<eos>", "<sep>", *task.tokenizer.alphabet]
    dataset = Dataset.from_dict(
        {
            "prompt": [" ".join(names[t] for t in p.prompt_tokens) for p in problems],
            "prompt_tokens": [list(p.prompt_tokens) for p in problems],
            "target_tokens": [list(p.target_tokens) for p in problems],
            "prompt_text": [p.prompt_text for p in problems],
            "target_text": [p.target_text for p in problems],
        }
    )
    assert tokenizer(dataset[0]["prompt"], add_special_tokens=False)["input_ids"] == list(
        problems[0].prompt_tokens
    )

    def reward(completions, completion_ids, prompt_tokens, target_tokens, prompt_text,
               target_text, **_):  # fmt: skip
        return [
            task.reward(
                Problem(prompt_tokens=p, target_tokens=t, prompt_text=pt, target_text=tt), ids
            )
            for ids, p, t, pt, tt in zip(
                completion_ids, prompt_tokens, target_tokens, prompt_text, target_text
            )
        ]

    accumulation = b.samples_per_optimizer_step // b.micro_batch_size
    opt, alg = cfg.optimizer, cfg.algorithm
    args = GRPOConfig(
        output_dir=seed_out,
        per_device_train_batch_size=b.micro_batch_size,
        gradient_accumulation_steps=accumulation,
        num_generations=b.samples_per_prompt,
        max_completion_length=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        learning_rate=opt.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.betas[0],
        adam_beta2=opt.betas[1],
        adam_epsilon=opt.eps,
        max_grad_norm=opt.grad_clip,
        beta=0.0,
        loss_type="dapo",  # token-mean over the optimizer step's tokens
        epsilon=alg.clip_low,
        epsilon_high=alg.clip_high,
        entropy_coef=alg.entropy_coef,
        num_iterations=1,
        scale_rewards="group",
        shuffle_dataset=False,
        max_steps=steps,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        seed=cfg.train.seed,
        dataloader_num_workers=0,
    )
    ends: list[float] = []
    gen: list[float] = []

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, inputs: Any) -> Any:
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            gen.append(time.perf_counter() - t0)
            return out

    class StepEnd(TrainerCallback):
        def on_step_end(self, *a: Any, **k: Any) -> None:
            ends.append(time.perf_counter())

    trainer = Timed(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepEnd()],
    )
    trainer.train()
    history = [h for h in trainer.state.log_history if "reward" in h]
    return {
        "first_step": 1,  # step k runs from the end of step k-1 to its own end
        "step_s": [b - a for a, b in itertools.pairwise(ends)],
        "generation_s": gen[1 : len(ends)],
        "reward": [h["reward"] for h in history],
        "response_length": [h.get("completions/mean_length") for h in history],
    }


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        total = int(args.warmup) + int(args.steps) + 1  # the last step has no end mark (both)
        data = workload_config(args.workload, total, f"{tmp}/run")
        out = run_unirl(data) if args.child == "unirl" else run_trl(data, f"{tmp}/trl")
    out["torch_threads_after"] = torch.get_num_threads()  # neither trainer may change it
    print(RESULT_PREFIX + json.dumps(out), flush=True)


# -- the parent ---------------------------------------------------------------------------


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def one_run(trainer: str, workload: str, args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", trainer,
           "--workload", workload, "--steps", str(args.steps[workload]),
           "--warmup", str(args.warmup[workload]), "--threads", str(args.threads)]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if proc.returncode or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
        raise SystemExit(f"{trainer} run of {workload} failed (exit {proc.returncode})")
    raw = json.loads(lines[-1][len(RESULT_PREFIX) :])
    w = args.warmup[workload]
    steps, gen = raw["step_s"][w:], raw["generation_s"][w:]
    rest = [s - g for s, g in zip(steps, gen)]
    return {
        "trainer": trainer,
        "wall_s": round(time.perf_counter() - t0, 1),
        "measured_steps": len(steps),
        "torch_threads_after": raw["torch_threads_after"],
        "median_step_s": _median(steps),
        "median_generation_s": _median(gen),
        "median_rest_s": _median(rest),
        "mean_reward_measured_steps": statistics.fmean(
            raw["reward"][raw["first_step"] + w : raw["first_step"] + w + len(steps)]
        ),
        "step_s": [round(x, 5) for x in raw["step_s"]],
        "generation_s": [round(x, 5) for x in raw["generation_s"]],
        "reward_per_step": [round(x, 5) for x in raw["reward"]],
        "response_length_per_step": raw["response_length"],
    }


def benchmark(workload: str, args: argparse.Namespace) -> dict[str, Any]:
    runs, ratios = [], []
    for pair in range(args.pairs):
        order = ["unirl", "trl"] if pair % 2 == 0 else ["trl", "unirl"]
        done = {}
        for trainer in order:
            run = one_run(trainer, workload, args)
            run["pair"] = pair
            runs.append(run)
            done[trainer] = run
            print(
                f"{workload} pair {pair} {trainer}: {run['median_step_s']:.4f} s/step "
                f"(generation {run['median_generation_s']:.4f}, rest {run['median_rest_s']:.4f}), "
                f"reward {run['mean_reward_measured_steps']:.3f}",
                flush=True,
            )
        ratios.append(done["unirl"]["median_step_s"] / done["trl"]["median_step_s"])

    def pooled(trainer: str, key: str) -> float:
        return _median([r[key] for r in runs if r["trainer"] == trainer])

    summary = {
        t: {k: pooled(t, k) for k in ("median_step_s", "median_generation_s", "median_rest_s")}
        for t in ("unirl", "trl")
    }
    # Each pair ran back to back, so its ratio is the least exposed to the machine's load
    # drifting over the invocation: the target is judged on their median.
    ratio = _median(ratios)
    target = WORKLOADS[workload]["target_ratio"]
    spec = WORKLOADS[workload]
    return {
        "config": spec["config"],
        "overrides": spec["overrides"],
        "warmup_steps": args.warmup[workload],
        "measured_steps": args.steps[workload],
        "pairs": args.pairs,
        "summary": summary,
        "ratio_step_unirl_over_trl": ratio,  # median over pairs
        "ratio_of_pooled_median_steps": summary["unirl"]["median_step_s"]
        / summary["trl"]["median_step_s"],
        "ratio_rest_unirl_over_trl": summary["unirl"]["median_rest_s"]
        / summary["trl"]["median_rest_s"],
        "ratio_per_pair": ratios,
        "target_ratio": target,
        "target_met": ratio <= target,
        "runs": runs,
    }


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "trl", "deepspeed", "accelerate"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "absent"
    return out


def _per_workload(
    parser: argparse.ArgumentParser, flag: str, text: str | None, names: list[str], key: str
) -> dict[str, int]:
    """``N`` for every workload, or ``tiny=N,long=M``; the workload's default where unset."""
    values = {w: int(WORKLOADS[w][key]) for w in names}
    if text is None:
        return values
    try:
        if "=" not in text:
            return dict.fromkeys(names, int(text))
        for part in text.split(","):
            name, _, number = part.partition("=")
            if name not in WORKLOADS:
                parser.error(f"{flag}: unknown workload {name!r}; choose from {sorted(WORKLOADS)}")
            values[name] = int(number)
    except ValueError:
        parser.error(f"{flag}={text!r}: give a number or name=number pairs, e.g. tiny=100,long=8")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="tiny,long", help="comma-separated: tiny,long")
    parser.add_argument(
        "--steps", help="measured steps per run: N, or per workload as tiny=N,long=M (default: "
        + ", ".join(f"{w}={s['steps']}" for w, s in WORKLOADS.items()) + ")",
    )  # fmt: skip
    parser.add_argument(
        "--warmup", help="steps dropped first, as --steps (default: "
        + ", ".join(f"{w}={s['warmup']}" for w, s in WORKLOADS.items()) + ")",
    )  # fmt: skip
    parser.add_argument("--pairs", type=int, default=3, help="unirl/TRL pairs per workload")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    parser.add_argument(
        "--threads",
        type=int,
        default=max((cores or 1) - 1, 1),
        help="torch threads of both trainers (default: unirl's own default, cores - 1)",
    )
    parser.add_argument(
        "--out", default=None, help="default: a new dated file under results/cpu_vs_trl/"
    )
    parser.add_argument("--note", default="", help="stored with the results (e.g. machine load)")
    parser.add_argument("--child", choices=["unirl", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.out is None:
        args.out = str(new_result_path("cpu_vs_trl", "cpu"))
    if args.child:
        child(args)
        return
    names = [w for w in args.workloads.split(",") if w]
    unknown = set(names) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workload(s) {sorted(unknown)}; choose from {sorted(WORKLOADS)}")
    args.steps = _per_workload(parser, "--steps", args.steps, names, "steps")
    args.warmup = _per_workload(parser, "--warmup", args.warmup, names, "warmup")
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    results = {w: benchmark(w, args) for w in names}
    report = {
        "command": "python " + " ".join(sys.argv),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "note": args.note,
        "cores": cores,
        "threads_both": args.threads,
        "load_average_before_after": [load_before, os.getloadavg()],
        "wall_s": round(time.perf_counter() - t0, 1),
        "versions": _versions(),
        "matched": "model, starting weights, token ids, prompts and their order, reward, "
        "16 prompts x 8 samples, max new tokens, temperature 1, PPO-clip 0.2/0.28 token-mean, "
        "entropy 0.01, no KL, AdamW (lr 5e-4, betas, eps, no weight decay), grad clip 1.0, "
        "constant LR, one optimizer step per rollout, the same microbatch size, fp32, threads",
        "not_matched": UNMATCHED,
        "workloads": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    for w, r in results.items():
        s = r["summary"]
        print(
            f"{w}: unirl {s['unirl']['median_step_s']:.4f} s/step (gen "
            f"{s['unirl']['median_generation_s']:.4f}, rest {s['unirl']['median_rest_s']:.4f}); "
            f"TRL {s['trl']['median_step_s']:.4f} (gen {s['trl']['median_generation_s']:.4f}, "
            f"rest {s['trl']['median_rest_s']:.4f}); ratio {r['ratio_step_unirl_over_trl']:.3f} "
            f"(median of pairs; of pooled medians {r['ratio_of_pooled_median_steps']:.3f}) "
            f"(target <= {r['target_ratio']}: {'met' if r['target_met'] else 'NOT met'}; "
            f"per pair {', '.join(f'{x:.3f}' for x in r['ratio_per_pair'])})"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
