"""`unirl train` on the tiny Qwen3-MoE example (DeepSpeed on the CPU, one process, a seeded model:
what a fresh clone runs), with routing replay off and record: the router's auxiliary losses are
reported, and record makes the old-log-prob forward run (and record) while off reuses."""

import pytest

pytest.importorskip("deepspeed", reason="needs deepspeed (pip install unirl[deepspeed])")
pytest.importorskip("transformers", reason="needs transformers (pip install unirl[hf])")

from tests.unit.test_train import EXAMPLES, _run_train_in_subprocess
from unirl.core.run.metrics_log import read_metrics


@pytest.mark.parametrize("mode", ["off", "record"])
def test_tiny_qwen3_moe_trains(tmp_path, mode):
    steps = 2
    proc = _run_train_in_subprocess(
        [str(EXAMPLES / "tiny_qwen3_moe.yaml"), "--set", f"logging.run_dir={tmp_path / 'run'}",
         "--set", f"train.rl_steps={steps}", "--set", f"algorithm.routing_replay={mode}",
         "--set", "batch.prompts_per_rollout=4", "--set", "batch.samples_per_optimizer_step=32",
         "--set", "batch.micro_batch_size=16", "--set", "logging.tensorboard=false"],
        tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for row in rows:
        # top-2 of 8 experts: the balance loss is k = 2 when balanced, more when not
        assert 1.0 < row["router/aux_loss"] < 8.0
        assert row["router/z_loss"] > 0.0
    if mode == "record":
        assert rows[0]["old_logprobs/source"] == "recompute"
        # one optimizer step per rollout: the training forward runs the recording weights
        assert all(r["router/disagreement"] == 0.0 for r in rows)
    else:
        assert rows[0]["old_logprobs/source"] == "reuse"
        assert "router/disagreement" not in rows[0]
    assert (tmp_path / "run" / "hf" / "config.json").exists()
