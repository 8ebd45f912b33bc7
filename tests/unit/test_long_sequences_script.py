"""`benchmarks/long_sequences.sh`'s offloaded 4B rows, dry-run on the CPU: every length divided by
``SHRINK`` and a tiny shape appended (``EXTRA``), the same commands the GPU runs otherwise. Each
row's JSON holds the MFU counted on 6N + attention, the offload choice and `unirl check`'s memory
plan. Slow (two engine builds, ~1 minute on a loaded 2-core machine): ``--runslow``."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_offloaded_rows_run_on_the_cpu(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OUT": str(tmp_path),
        "SHRINK": "1024",
        "EXTRA": "--device cpu --layers 1 --hidden 64",
    }
    rows = ["m4b-64k-offload", "f4b-64k-offload"]
    subprocess.run(["bash", "benchmarks/long_sequences.sh", *rows], cwd=ROOT, env=env, check=True)
    megatron = json.loads((tmp_path / "m4b-64k-offload.json").read_text())
    reuse = megatron["results"]["reuse"]
    assert megatron["batch"]["tokens"] == 64 and megatron["batch"]["optimizer_offload"] is True
    assert "HybridDeviceOptimizer" in megatron["memory_plan"]["optimizer_state"]
    assert reuse["summary"]["train_mfu"] > 0 and reuse["peak_host_rss_gib"] > 0
    assert megatron["flops"]["train_pass"] > 0  # 6N + attention (megatron_throughput.model_flops)
    # the host's Adam step timed apart: one per timed RL step, a part of its training phase
    (opt,), (train,) = reuse["optimizer_s"], reuse["train_s"]
    assert 0 < opt < train
    fsdp2 = json.loads((tmp_path / "f4b-64k-offload.json").read_text())
    row = fsdp2["table"]["fsdp2"]
    assert row["optimizer_offload"] is True and row["mfu"] > 0
    plan = fsdp2["engines"]["fsdp2"]["results"]["reuse"]["memory_plan"]
    assert "CPUOffloadPolicy" in plan["optimizer_state"]
    reuse = fsdp2["engines"]["fsdp2"]["results"]["reuse"]
    assert len(reuse["optimizer_s"]) == len(reuse["train_s"])
    assert all(0 < o < t for o, t in zip(reuse["optimizer_s"], reuse["train_s"], strict=True))
