"""Dynamic sampling (DAPO) on a prompt set where most groups are uniform: steps and wall time to a
target reward with and without it, several seeds, and the share of generation spent on groups
that were thrown away. The tiny example's model and backend (DeepSpeed on the CPU, built-in
sampler), on task `mixed_task`: a quarter of the prompts are learnable (reverse two digits,
partial credit per position), the rest are trivially easy (reward 1 whatever the answer) or
unsolvable (reward 0): their groups are uniform, so GRPO learns nothing from them.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/dynamic_sampling.py [--seeds 1 2 3] \
        [--steps 200] [--steps-off 600] [--target 0.5]

The target is the mean reward on the *learnable* prompts. With dynamic sampling every trained
group is learnable, so it is the logged ``reward/mean``; without it the step's rollout mixes the
kinds, and the learnable mean is recovered exactly from the logged mean and the rollout's
composition (the prompt stream is `random.Random(train.seed)`, replayed here). The first step
whose 5-step running mean reaches the target is reported. Writes a new dated file under
``benchmarks/results/dynamic_sampling/`` (``benchmarks/result_files.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import attrs

from benchmarks.result_files import new_result_path
from unirl.rollouts.data.tasks import DIGITS, Problem, ReverseDigits, positional_reward
from unirl.rollouts.data.tokenizer import CharTokenizer

ROOT = Path(__file__).resolve().parents[1]
PROMPTS, GROUP = 4, 8  # batch.prompts_per_rollout, batch.samples_per_prompt
WINDOW = 5


@attrs.frozen
class MixedTask:
    """Reverse two digits; ``learnable`` of the prompts are scored by position, the rest are
    uniform: half of them always 1 (trivially easy), half always 0 (unsolvable)."""

    learnable: float = 0.25
    name: str = "mixed_task"
    tokenizer: CharTokenizer = attrs.field(factory=lambda: CharTokenizer(DIGITS))
    inner: ReverseDigits = attrs.field(factory=lambda: ReverseDigits(min_digits=2, max_digits=2))

    @property
    def max_prompt_length(self) -> int:
        return self.inner.max_prompt_length

    @property
    def max_target_length(self) -> int:
        return self.inner.max_target_length

    def sample_problem(self, rng: random.Random) -> Problem:
        u = rng.random()
        kind = (
            "learn" if u < self.learnable else ("easy" if u < (1 + self.learnable) / 2 else "hard")
        )
        return attrs.evolve(self.inner.sample_problem(rng), metadata={"kind": kind})

    def reward(self, problem: Problem, response_tokens: Sequence[int]) -> float:
        kind = problem.metadata["kind"]
        if kind == "learn":
            return positional_reward(response_tokens, problem.target_tokens)
        return 1.0 if kind == "easy" else 0.0


def mixed_task(**options: float) -> MixedTask:
    """``rollout.task: benchmarks.dynamic_sampling:mixed_task``."""
    return MixedTask(**options)


def _kinds(seed: int, steps: int) -> list[list[str]]:
    """The kinds of each step's prompts without dynamic sampling (one draw per step)."""
    rng, task = random.Random(seed), MixedTask()
    return [
        [task.sample_problem(rng).metadata["kind"] for _ in range(PROMPTS)] for _ in range(steps)
    ]


def _train(run_dir: Path, seed: int, steps: int, dynamic: bool) -> tuple[list[dict], float]:
    args = [sys.executable, "-m", "unirl.cli", "train", str(ROOT / "examples/tiny_grpo.yaml"),
            "--set", f"logging.run_dir={run_dir}", "--set", "logging.tensorboard=false",
            "--set", "checkpoint.export_hf=false", "--set", "checkpoint.every=0",
            "--set", "progress.enabled=false", "--set", f"train.seed={seed}",
            "--set", f"train.rl_steps={steps}", "--set", f"batch.prompts_per_rollout={PROMPTS}",
            "--set", f"batch.samples_per_prompt={GROUP}",
            "--set", f"batch.samples_per_optimizer_step={PROMPTS * GROUP}",
            "--set", "batch.micro_batch_size=32",
            "--set", "rollout.task=benchmarks.dynamic_sampling:mixed_task",
            "--set", "rollout.task_options={}",
            "--set", f"rollout.dynamic_sampling.enabled={str(dynamic).lower()}",
            "--set", "rollout.dynamic_sampling.max_draws=12"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    subprocess.run(args, check=True, env=env, capture_output=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], wall


def _learnable_means(rows: list[dict], seed: int, dynamic: bool) -> list[float | None]:
    """Each step's mean reward on learnable prompts (None: the step had none)."""
    if dynamic:
        return [r["reward/mean"] for r in rows]
    out: list[float | None] = []
    for r, kinds in zip(rows, _kinds(seed, len(rows))):
        n_learn, n_easy = kinds.count("learn"), kinds.count("easy")
        total = r["reward/mean"] * PROMPTS * GROUP
        out.append((total - n_easy * GROUP) / (n_learn * GROUP) if n_learn else None)
    return out


def _first_reach(means: list[float | None], target: float) -> int | None:
    seen: list[float] = []
    for step, m in enumerate(means, start=1):
        if m is not None:
            seen.append(m)
        if len(seen) >= WINDOW and statistics.mean(seen[-WINDOW:]) >= target:
            return step
    return None


def _one(tmp: Path, seed: int, steps: int, target: float, dynamic: bool) -> dict:
    rows, wall = _train(tmp / f"s{seed}_{int(dynamic)}", seed, steps, dynamic)
    means = _learnable_means(rows, seed, dynamic)
    reach = _first_reach(means, target)
    seen = [m for m in means if m is not None]
    step_s = [r["time/generation_s"] + r["time/step_s"] for r in rows]
    entry: dict = {
        "first_step_at_target": reach,
        "seconds_to_target": sum(step_s[:reach]) if reach else None,
        "steps_run": len(rows),
        "learnable_reward_first10": statistics.mean(seen[:10]),
        "learnable_reward_last10": statistics.mean(seen[-10:]),
        "process_wall_s": wall,
        "generation_s_total": sum(r["time/generation_s"] for r in rows),
    }
    if dynamic:
        gen = [r["time/generation_s"] for r in rows]
        discarded = [r["rollout/discarded_generation_s"] for r in rows]
        entry["draws_per_step_mean"] = statistics.mean(r["rollout/draws"] for r in rows)
        entry["groups_kept_fraction_mean"] = statistics.mean(
            r["rollout/groups_kept_fraction"] for r in rows
        )
        entry["padding_groups_total"] = sum(r["rollout/padding_groups"] for r in rows)
        entry["discarded_generation_fraction"] = sum(discarded) / sum(gen)
    else:
        # every uniform group is generated and trained for nothing
        kinds = [k for step in _kinds(seed, len(rows)) for k in step]
        entry["uniform_group_fraction"] = 1 - kinds.count("learn") / len(kinds)
    return entry


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=200)
    # without dynamic sampling a step trains a quarter of the groups: give it more steps
    parser.add_argument("--steps-off", type=int, default=600)
    parser.add_argument("--target", type=float, default=0.5)
    args = parser.parse_args()
    out = new_result_path("dynamic_sampling", "cpu")
    result: dict = {
        "command": "PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/dynamic_sampling.py "
        + " ".join(sys.argv[1:]),
        "config": "examples/tiny_grpo.yaml with rollout.task=benchmarks.dynamic_sampling:mixed_task",
        "prompts_per_rollout": PROMPTS,
        "samples_per_prompt": GROUP,
        "learnable_fraction": MixedTask().learnable,
        "target_learnable_reward": args.target,
        "running_mean_window": WINDOW,
        "threads": {
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "cpu_count": os.cpu_count(),
        },
        "runs": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for dynamic in (False, True):
                steps = args.steps if dynamic else args.steps_off
                entry = _one(Path(tmp), seed, steps, args.target, dynamic)
                key = f"seed={seed} dynamic_sampling={'on' if dynamic else 'off'}"
                result["runs"][key] = entry
                print(f"{key}: {json.dumps(entry)}", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
