"""Issue 15, finding 2: a run whose weights or gradients stop being finite stops with a non-zero
exit and exports nothing; a run of skipped optimizer steps stops after the configured count."""

import subprocess
import sys
from pathlib import Path

import pytest

from unirl.core.errors import RunError
from unirl.core.run.divergence import DivergenceGuard

EXAMPLES = Path(__file__).parents[2] / "examples"
FINE = None  # every weight finite (what backend.non_finite_weight() returns then)


def test_non_finite_weights_stop_at_once():
    guard = DivergenceGuard(max_consecutive_skips=0)
    guard.after_step(1, {"skipped_steps": 0.0}, FINE)
    with pytest.raises(RunError, match=r"not finite after RL step 2 \(first in b"):
        guard.after_step(2, {}, "b")


def test_consecutive_skips_stop_after_the_limit():
    guard = DivergenceGuard(max_consecutive_skips=3)
    # RL steps of 2 optimizer steps each: skipped fractions 1, 0.5 (resets), 1, then 1 -> 4 >= 3
    guard.after_step(1, {"skipped_steps": 1.0, "optimizer_steps": 2.0}, FINE)
    guard.after_step(2, {"skipped_steps": 0.5, "optimizer_steps": 2.0}, FINE)
    guard.after_step(3, {"skipped_steps": 1.0, "optimizer_steps": 2.0}, FINE)
    with pytest.raises(RunError, match=r"4 optimizer steps in a row were skipped .*RL step 4"):
        guard.after_step(4, {"skipped_steps": 1.0, "optimizer_steps": 2.0}, FINE)
    never = DivergenceGuard(max_consecutive_skips=0)
    for step in range(1, 10):
        never.after_step(step, {"skipped_steps": 1.0, "optimizer_steps": 1.0}, FINE)


def test_train_that_diverges_exits_non_zero_and_exports_nothing(tmp_path):
    pytest.importorskip("deepspeed", reason="needs deepspeed (pip install unirl[deepspeed])")
    # lr=1e30 passes validation; the first update blows the weights up and the next rollout's
    # distribution is NaN. Before: a RuntimeError traceback from torch.multinomial (and with an
    # infinite lr, exit 0 and a NaN export)
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "unirl.cli", "train", str(EXAMPLES / "tiny_grpo.yaml"),
         "--set", f"logging.run_dir={run}", "--set", "optimizer.lr=1e30",
         "--set", "train.rl_steps=4", "--set", "batch.prompts_per_rollout=2",
         "--set", "batch.samples_per_optimizer_step=16", "--set", "batch.micro_batch_size=16",
         "--set", "logging.tensorboard=false"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "unirl: error: the policy's next-token distribution holds NaN" in proc.stderr
    assert not (run / "hf").exists()
