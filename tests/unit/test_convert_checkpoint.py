"""`unirl convert CHECKPOINT OUT`: a run's checkpoint -> a Hugging Face folder equal to the run's
own final export (``run_dir/hf``): every tensor bit for bit, the config and the tokenizer files.

One short run per backend (the tiny task, one RL step, checkpoint and export at the end), then
the command line, each in a fresh process (DeepSpeed keeps process-global state; megatron's
parallel state is global too).
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch", reason="needs safetensors")

EXAMPLES = Path(__file__).parents[2] / "examples"
NEEDS = {"megatron": "megatron", "fsdp2": "transformers", "deepspeed": "deepspeed"}


def _cli(args, cwd):
    root = str(Path(__file__).parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "unirl.cli", *args],
        cwd=cwd, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip


def _tensors(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= safetensors_torch.load_file(str(f))
    return out


@pytest.mark.parametrize(
    "backend",
    [
        "megatron",
        # the slow tier (tests/conftest.py): the conversion is the same code for every backend
        # (build from the recorded config, load the checkpoint, the backend's own export)
        pytest.param("fsdp2", marks=pytest.mark.slow),
        pytest.param("deepspeed", marks=pytest.mark.slow),
    ],
)
def test_checkpoint_to_hf_equals_the_runs_export(tmp_path, backend):
    if importlib.util.find_spec(NEEDS[backend]) is None:
        pytest.skip(f"needs {NEEDS[backend]} (pip install unirl[{backend}])")
    run = tmp_path / "run"
    train = _cli(
        ["train", str(EXAMPLES / "tiny_grpo.yaml"), "--set", f"backend={backend}",
         "--set", f"logging.run_dir={run}", "--set", "logging.tensorboard=false",
         "--set", "train.rl_steps=1", "--set", "batch.prompts_per_rollout=4",
         "--set", "batch.samples_per_prompt=2", "--set", "batch.samples_per_optimizer_step=8",
         "--set", "batch.micro_batch_size=4"],
        tmp_path,
    )  # fmt: skip
    assert train.returncode == 0, train.stderr[-3000:]
    (checkpoint,) = (run / "checkpoints").glob("step_*")
    out = tmp_path / "converted"
    conv = _cli(["convert", str(checkpoint), str(out)], tmp_path)
    assert conv.returncode == 0, conv.stderr[-3000:]
    assert conv.stdout.strip().endswith(str(out))
    export, converted = _tensors(run / "hf"), _tensors(out)
    assert set(converted) == set(export) and export
    for name, value in export.items():
        assert converted[name].dtype == value.dtype and torch.equal(converted[name], value), name
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (run / "hf" / "config.json").read_text()
    )
    tokenizer_files = sorted(p.name for p in (run / "hf").iterdir() if "token" in p.name)
    assert tokenizer_files, "the run exported its tokenizer"
    for name in tokenizer_files:
        assert (out / name).read_bytes() == (run / "hf" / name).read_bytes(), name
    # an existing OUT is never overwritten
    again = _cli(["convert", str(checkpoint), str(out)], tmp_path)
    assert again.returncode == 2 and "exists; choose a new directory" in again.stderr
    # a recorded config that names code to import is not built without --trust-checkpoint-code
    marker_path = checkpoint / "complete"
    marker = json.loads(marker_path.read_text())
    marker["unirl"]["config"]["algorithm"]["policy_loss"] = "not_a_module_here:run_me"
    marker_path.write_text(json.dumps(marker))
    refused = _cli(["convert", str(checkpoint), str(tmp_path / "refused")], tmp_path)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "algorithm.policy_loss='not_a_module_here:run_me'" in refused.stderr
    assert "--trust-checkpoint-code" in refused.stderr and not (tmp_path / "refused").exists()
    trusted = _cli(
        ["convert", str(checkpoint), str(tmp_path / "trusted"), "--trust-checkpoint-code"], tmp_path
    )
    # trusted, the config is built: its loss module is imported (and here does not exist)
    assert trusted.returncode != 0 and "not_a_module_here" in trusted.stderr
