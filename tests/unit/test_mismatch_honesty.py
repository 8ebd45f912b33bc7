"""With old_logprobs: rollout the train/rollout mismatch would compare the rollout's log-probs
with themselves: the run logs no mismatch metric then (the reuse run of the same job does:
tests/unit/test_wandb_log.py checks its metrics.jsonl holds them)."""

from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="needs deepspeed (pip install unirl[deepspeed])")

from tests.unit.test_train import EXAMPLES, _run_train_in_subprocess
from unirl.core.run.metrics_log import read_metrics

MISMATCH = ("train_rollout_logprob_abs_diff", "train_rollout_logprob_abs_diff_max",
            "train_rollout_kl")  # fmt: skip


def test_old_logprobs_rollout_logs_no_mismatch(tmp_path: Path):
    sets = ["old_logprobs=rollout", "train.rl_steps=2", "batch.prompts_per_rollout=4",
            "batch.samples_per_prompt=4", "batch.samples_per_optimizer_step=16",
            "batch.micro_batch_size=16", "logging.tensorboard=false",
            f"logging.run_dir={tmp_path / 'run'}"]  # fmt: skip
    args = [str(EXAMPLES / "tiny_grpo.yaml"), *[a for s in sets for a in ("--set", s)]]
    proc = _run_train_in_subprocess(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert "reward/mean" in row and "pg_loss" in row
        assert not set(MISMATCH) & set(row)
