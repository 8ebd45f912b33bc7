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


REPLAY_ROLLOUTS = EXAMPLES / "tiny_qwen3_moe_rollouts.jsonl"


def _train_replay_example(tmp_path, mode: str, steps: int) -> list[dict]:
    run = tmp_path / f"run_{mode}"
    proc = _run_train_in_subprocess(
        [str(EXAMPLES / "tiny_qwen3_moe_replay.yaml"), "--set", f"logging.run_dir={run}",
         "--set", f"rollout.file={REPLAY_ROLLOUTS}", "--set", f"train.rl_steps={steps}",
         "--set", f"algorithm.routing_replay={mode}", "--set", "logging.tensorboard=false",
         "--set", "checkpoint.export_hf=false"],
        tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_metrics(run / "metrics.jsonl")


def test_tiny_qwen3_moe_trains_with_replay_from_a_rollout_file(tmp_path):
    """R3 end to end from a file (vLLM's CPU build returns no routed experts): the example's
    rollouts carry the routing of a router-noise copy of the model, which every forward replays;
    router/disagreement counts the decisions where the trainer's router would have chosen others
    (about 10% at noise 0.1, examples/make_moe_rollouts.py)."""
    rows = _train_replay_example(tmp_path, "rollout", steps=2)
    assert [r["step"] for r in rows] == [1, 2]
    assert 0.02 < rows[0]["router/disagreement"] < 0.5
    assert rows[0]["train_rollout_logprob_abs_diff"] > 0.0
    assert all(r["grad_norm"] > 0.0 for r in rows)


@pytest.mark.slow
def test_replaying_the_rollouts_routing_lowers_the_train_rollout_mismatch(tmp_path):
    """Step 1 (the trainer holds the sampling weights but for the router noise): the mismatch
    with replay is below the mismatch without (benchmarks/routing_replay_mismatch.py measures it
    per noise level)."""
    off = _train_replay_example(tmp_path, "off", steps=1)[0]
    replay = _train_replay_example(tmp_path, "rollout", steps=1)[0]
    for key in ("train_rollout_logprob_abs_diff", "train_rollout_kl"):
        assert replay[key] < 0.5 * off[key], (key, replay[key], off[key])
