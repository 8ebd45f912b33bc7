"""`benchmarks/serve_overhead.py --shape qwen3-4b` (issue 47's one-GPU row), dry-run on the CPU
with a shrunken Qwen3-4B shape: the SDK step through an in-process server and the direct step
on the server client's own backend, end to end; the JSON's figures recomputed here from its step
times. Slow (a server and a backend build, ~20 s on a loaded 2-core machine): ``--runslow``."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "serve_overhead.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(SCRIPT), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_qwen3_4b_row_dry_run_on_the_cpu(tmp_path):
    out = tmp_path / "row.json"
    shrink = ("--layers", "1", "--hidden", "256", "--vocab", "1024", "--tokens", "128")
    proc = _run("--shape", "qwen3-4b", "--device", "cpu", *shrink, "--steps", "2", "--repeats", "1",
                "--small", "0", "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    # Qwen3-4B's layer but for the overrides: heads of 128 (256 wide: 2 heads, both kv), tied
    # embeddings, q / k norm (qwen3), the intermediate 4 x hidden
    m = r["model"]
    assert (m["model_type"], m["num_hidden_layers"], m["hidden_size"]) == ("qwen3", 1, 256)
    assert (m["num_attention_heads"], m["num_key_value_heads"], m["head_dim"]) == (2, 2, 128)
    assert (m["intermediate_size"], m["vocab_size"], m["tie_word_embeddings"]) == (1024, 1024, True)
    # the LoRA rows' adapter: rank 16, alpha 32, every decoder linear, not the tied head
    lora = r["lora"]  # the training client's model.lora, as the server built it
    assert (lora["rank"], lora["alpha"]) == (16, 32.0)
    assert lora["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # fmt: skip
    assert r["train"]["model"]["fused_head"] is True and r["direct"] == "server"
    assert r["step"] == {"datums": 1, "tokens_per_datum": 128}
    server, direct = r["server_step_s"], r["direct_step_s"]
    assert len(server) == len(direct) == 2
    assert r["server_tokens_per_s"] == pytest.approx(128 / statistics.median(server))
    assert r["direct_tokens_per_s"] == pytest.approx(128 / statistics.median(direct))
    pairs = sorted(s / d - 1.0 for s, d in zip(server, direct))
    assert r["overhead_median_of_pairs"] == pytest.approx((pairs[0] + pairs[1]) / 2)
    assert r["device_name"] == "cpu" and r["peak_memory_gib"] is None  # no GPU


@pytest.mark.slow
def test_cuda_without_a_gpu_is_refused():
    proc = _run("--shape", "qwen3-4b", "--device", "cuda")
    assert proc.returncode == 2
    assert (
        "--device cuda: this machine has no CUDA device; --device cpu for a dry run" in proc.stderr
    )
