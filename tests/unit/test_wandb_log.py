"""logging.wandb: an offline W&B run of `unirl train` holds, at every step, the same values as
metrics.jsonl (read back from the run's .wandb file by a reader written here: LevelDB-log
records of W&B's protobuf `Record`); without logging.wandb there is no W&B run; configured but
not installed, the config check refuses it."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from unirl.core.config.run_config import load_config
from unirl.core.errors import ConfigError
from unirl.core.run.metrics_log import read_metrics

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "tiny_grpo.yaml"


def read_offline_history(run_file: Path) -> dict[int, dict]:
    """{step: {key: value}} of the history records of a W&B transaction log: a 7-byte header
    (":W&B", magic, version), then 32 KiB blocks of records, each a 7-byte header (crc32,
    length, type: 1 full, 2 first, 3 middle, 4 last) and its bytes; a block's tail of under 7
    bytes is padding."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos = run_file.read_bytes(), 32768, 7
    assert data[:4] == b":W&B"
    records, part = [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:  # zero padding to the block's end
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        part = chunk if kind in (1, 2) else part + chunk
        if kind in (1, 4):
            records.append(part)
    history = {}
    for raw in records:
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            history[items["_step"]] = items
    return history


def train(run: Path, *extra: str) -> None:
    sets = ["train.rl_steps=2", "batch.prompts_per_rollout=4", "batch.samples_per_prompt=4",
            "batch.samples_per_optimizer_step=16", "batch.micro_batch_size=16",
            "logging.tensorboard=false", f"logging.run_dir={run}", *extra]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "unirl.cli", "train", str(EXAMPLE),
         *[a for s in sets for a in ("--set", s)]],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
             "WANDB_MODE": "offline"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_offline_wandb_history_equals_metrics_jsonl(tmp_path):
    pytest.importorskip("wandb", reason="needs wandb (pip install -e '.[wandb]')")
    pytest.importorskip("deepspeed", reason="needs deepspeed")
    run = tmp_path / "run"
    train(run, "logging.wandb={project: unirl-test, mode: offline}")
    files = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    history = read_offline_history(files[0])
    rows = read_metrics(run / "metrics.jsonl")
    assert sorted(history) == [r["step"] for r in rows] == [1, 2]
    for row in rows:
        logged = history[row["step"]]
        numbers = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
        assert "reward/mean" in numbers and "train_rollout_logprob_abs_diff" in numbers
        # the flat names (loss, grad_norm, ...) under train/ on the dashboard, written out here
        named = {(k if "/" in k else "train/" + k): v for k, v in numbers.items()}
        assert named["train/loss"] == row["loss"] and named["reward/mean"] == row["reward/mean"]
        for key, value in named.items():
            assert logged[key] == pytest.approx(value, rel=1e-12, abs=0), key
        # nothing but the metrics, W&B's own bookkeeping and, at step 1, the completions table
        table = {k for k in logged if k.startswith("completions/")}
        assert bool(table) == (row["step"] == 1)
        assert {k for k in logged if not k.startswith("_")} == set(named) | table
    shown = history[1]  # the first 4 samples of rollout 1, as completions.jsonl holds them
    first = json.loads((run / "completions.jsonl").read_text().split("\n")[0])
    assert shown["completions/_type"] == "table-file" and shown["completions/nrows"] == 4
    assert shown["completions/ncols"] == len(first)
    run_id = json.loads((run / "run.json").read_text())["run_id"]
    assert files[0].name == f"run-{run_id}.wandb"


def test_wandb_is_off_by_default_and_missing_wandb_is_a_config_error(tmp_path, monkeypatch):
    cfg = load_config(EXAMPLE)
    assert cfg.logging.wandb is None
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"logging.wandb is set but Weights & Biases is not "
                       r"installed: pip install -e '.\[wandb\]'"):  # fmt: skip
        load_config(EXAMPLE, ["logging.wandb={project: p}"])
    with pytest.raises(ConfigError, match=r"logging.wandb.mode: 'cloud' is not valid"):
        load_config(EXAMPLE, ["logging.wandb={mode: cloud}"])
