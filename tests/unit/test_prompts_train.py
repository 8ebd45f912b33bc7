"""`unirl train` on the example prompt file (examples/tiny_math.yaml) end to end: a few RL steps
with text prompts, the math_answer reward and a checkpoint, and the tokenizer saved with the
export."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="needs deepspeed (pip install unirl[deepspeed])")
pytest.importorskip("transformers", reason="needs transformers (pip install unirl[hf])")

from unirl.core.run.metrics_log import read_metrics

ROOT = Path(__file__).parents[2]


def test_tiny_math_trains_and_exports_its_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    run = tmp_path / "run"
    sizes = ["batch.prompts_per_rollout=4", "batch.samples_per_prompt=4",
             "batch.samples_per_optimizer_step=16", "batch.micro_batch_size=16"]  # fmt: skip
    args = [str(ROOT / "examples" / "tiny_math.yaml"), f"logging.run_dir={run}",
            "train.rl_steps=2", "checkpoint.every=1", "logging.tensorboard=false", *sizes]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "unirl.cli", "train", args[0],
         *[a for arg in args[1:] for a in ("--set", arg)]],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in rows)
    # The export's tokenizer is the character tokenizer over the file: ids 0-3 special, then
    # every character of the prompts and metadata values in code-point order (written here from
    # the documented rule).
    records = [json.loads(line) for line in (ROOT / "examples" / "math_prompts.jsonl").open()]
    chars = set()
    for r in records:
        chars |= set(r["prompt"]) | set(str(r["metadata"]["answer"])) | set(r["metadata"]["kind"])
    ids = {c: 4 + i for i, c in enumerate(sorted(chars))}
    tokenizer = AutoTokenizer.from_pretrained(str(run / "hf"))
    assert len(tokenizer) == 4 + len(chars)
    prompt = records[5]["prompt"]
    assert tokenizer(prompt)["input_ids"] == [1, *(ids[c] for c in prompt), 3]
