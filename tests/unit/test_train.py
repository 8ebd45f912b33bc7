"""The main job end to end on the CPU: a few RL steps of the tiny task on the embedded default
(DeepSpeed, one process), its outputs, resume, and training on a rollout file."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

pytest.importorskip("deepspeed", reason="needs deepspeed (pip install unirl[deepspeed])")
pytest.importorskip("transformers", reason="needs transformers (pip install unirl[hf])")

from unirl.core.run.metrics_log import read_metrics

EXAMPLES = Path(__file__).parents[2] / "examples"


def _run_train_in_subprocess(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    # a fresh process per run: DeepSpeed keeps process-global state; the repository root on the
    # path so that the `tests.unit.custom_hooks` hooks import
    root = str(Path(__file__).parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "unirl.cli", "train", *args],
        cwd=cwd, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip


def run_full_and_resumed(base: list[str], tmp_path: Path) -> tuple[list[dict], list[dict]]:
    """The metrics rows of ``base`` run for 4 RL steps uninterrupted (run dir ``full``) and cut
    (``cut``): stopped after step 2 (a checkpoint), then resumed in the same run dir to step 4."""
    full = _run_train_in_subprocess(
        [*base, "--set", f"logging.run_dir={tmp_path / 'full'}", "--set", "train.rl_steps=4"],
        tmp_path,
    )
    assert full.returncode == 0, full.stderr[-3000:]
    cut = [*base, "--set", f"logging.run_dir={tmp_path / 'cut'}", "--set", "checkpoint.every=2"]
    first = _run_train_in_subprocess([*cut, "--set", "train.rl_steps=2"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    second = _run_train_in_subprocess([*cut, "--set", "train.rl_steps=4", "--resume"], tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    return read_metrics(tmp_path / "full" / "metrics.jsonl"), read_metrics(
        tmp_path / "cut" / "metrics.jsonl"
    )


def assert_same_export(tmp_path: Path, folder: str) -> dict[str, torch.Tensor]:
    """The ``full`` and ``cut`` runs of `run_full_and_resumed` exported bit-identical weights
    (the full run's, returned)."""
    wa = load_file(str(tmp_path / "full" / folder / "model.safetensors"))
    wb = load_file(str(tmp_path / "cut" / folder / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa), folder
    return wa


def test_tiny_run_learns_and_writes_outputs(tmp_path):
    steps = 40
    proc = _run_train_in_subprocess(
        [str(EXAMPLES / "tiny_grpo.yaml"), "--set", f"logging.run_dir={tmp_path / 'run'}",
         "--set", f"train.rl_steps={steps}", "--set", "checkpoint.every=20",
         "--set", "logging.tensorboard=false"],
        tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for key in (
        "reward/mean",
        "reward/std",
        "loss",
        "pg_loss",
        "ppo_kl",
        "entropy",
        "pg_clipfrac",
        "grad_norm",
        "throughput/train_tokens_per_s",
        "time/train_s",
        "old_logprobs/source",
    ):
        assert key in rows[-1], key
    assert rows[0]["old_logprobs/source"] == "reuse"
    first = rows[0]["reward/mean"]
    last = sum(r["reward/mean"] for r in rows[-5:]) / 5
    assert last > first, (first, last)
    # checkpoints at 20 and 40, both complete; the HF export loads as safetensors
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["step_0000020", "step_0000040"]
    assert all((run / "checkpoints" / c / "complete").is_file() for c in ckpts)
    weights = load_file(str(run / "hf" / "model.safetensors"))
    assert weights and json.loads((run / "hf" / "config.json").read_text())["vocab_size"] == 16
    assert (run / "config.yaml").is_file()
    # what the policy generated: the first 4 samples (one group) at step 1 and every 10 steps
    shown = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in shown] == [s for s in (1, 10, 20, 30, 40) for _ in range(4)]
    assert all(len({r["group"] for r in shown if r["step"] == s}) == 1 for s in (1, 10, 40))
    assert all(r["prompt"].isdigit() and isinstance(r["response"], str) for r in shown)
    assert all(0.0 <= r["reward"] <= 1.0 and r["finished"] in (True, False) for r in shown)
    assert [r["policy_version"] for r in shown[::4]] == [0, 9, 19, 29, 39]
    # the export carries the task's tokenizer: AutoTokenizer gives CharTokenizer's ids
    from transformers import AutoTokenizer

    from unirl.rollouts.data.tokenizer import CharTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(run / "hf"))
    assert tokenizer("3071")["input_ids"] == CharTokenizer("0123456789").encode(
        "3071", bos=True, sep=True
    )


@pytest.mark.slow  # 23 s: CI time (CI keeps resume == uninterrupted and the bad-resume cases)
def test_a_resume_that_fails_before_its_first_step_keeps_the_runs_config(tmp_path):
    """config.yaml says how the run's checkpoints were made: a --resume that dies before it
    trains a step (here its post-processing hook raises) leaves it as it was; the first step a
    resumed run completes writes the config it resumed with."""
    run = tmp_path / "run"
    base = [str(EXAMPLES / "tiny_grpo.yaml"), "--set", f"logging.run_dir={run}",
            "--set", "logging.tensorboard=false", "--set", "batch.prompts_per_rollout=4",
            "--set", "batch.samples_per_optimizer_step=32", "--set", "batch.micro_batch_size=16"]  # fmt: skip
    first = _run_train_in_subprocess([*base, "--set", "train.rl_steps=1"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    written = (run / "config.yaml").read_text()
    hook = "algorithm.rollout_postprocess_hook=tests.unit.custom_hooks:raising_hook"
    failed = _run_train_in_subprocess(
        [*base, "--set", "train.rl_steps=2", "--set", hook, "--resume"], tmp_path
    )
    assert failed.returncode != 0 and "this hook always fails" in failed.stderr
    assert (run / "config.yaml").read_text() == written
    resumed = _run_train_in_subprocess([*base, "--set", "train.rl_steps=2", "--resume"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["rl_steps"] == 2


def test_resume_equals_uninterrupted(tmp_path):
    # stop after step 2 (a checkpoint), then resume the same run dir to step 4
    base = [str(EXAMPLES / "tiny_grpo.yaml"), "--set", "logging.tensorboard=false",
            "--set", "batch.prompts_per_rollout=4", "--set", "batch.samples_per_optimizer_step=32"]  # fmt: skip
    a, b = run_full_and_resumed(base, tmp_path)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        for key in ("reward/mean", "loss", "grad_norm", "entropy", "ppo_kl"):
            assert ra[key] == rb[key], (ra["step"], key, ra[key], rb[key])
    assert_same_export(tmp_path, "hf")


def test_train_on_rollout_file(tmp_path):
    proc = _run_train_in_subprocess(
        [str(EXAMPLES / "tiny_grpo.yaml"), "--rollouts", str(EXAMPLES / "tiny_rollouts.jsonl"),
         "--set", f"logging.run_dir={tmp_path / 'run'}", "--set", "logging.tensorboard=false",
         "--set", "algorithm.rollout_correction.mode=tis",
         # issue 15 finding 3: the hook is called on every rollout (it zeroes the rewards)
         "--set", "algorithm.rollout_postprocess_hook=tests.unit.custom_hooks:zero_rewards_hook"],
        tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    # the file holds 2 rollouts of 128 samples: 2 RL steps, then a checkpoint and the export
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["reward/mean"] for r in rows] == [0.0, 0.0]  # the file's rewards are not all 0
    assert "is_weight_mean" in rows[0] and "train_rollout_logprob_abs_diff" in rows[0]
    assert (tmp_path / "run" / "checkpoints" / "step_0000002" / "complete").is_file()
    assert (tmp_path / "run" / "hf" / "model.safetensors").is_file()


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip(
        "matplotlib", reason="unirl plot needs matplotlib (pip install unirl[plot])"
    )
    from unirl.cli import main
    from unirl.core.run.metrics_log import MetricsLog

    log = MetricsLog(tmp_path, tensorboard=False)
    for step in range(1, 4):
        log.write(step, {"reward/mean": step / 3, "loss": 1.0 / step, "grad_norm": 0.5})
    log.close()
    assert main(["plot", str(tmp_path)]) == 0
    png = tmp_path / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plot", str(tmp_path / "missing")]) == 2  # names the missing metrics file


def test_ppo_critic_resume_equals_uninterrupted_and_exports_the_critic(tmp_path):
    """PPO with a critic (GAE, warm-up of 1 RL step, 2 optimizer steps per rollout): the critic's
    state is in the checkpoint, so a resumed run reproduces the uninterrupted one step for step,
    and its Hugging Face export reloads as a one-label token classifier."""
    base = [str(EXAMPLES / "tiny_ppo.yaml"), "--set", "logging.tensorboard=false",
            "--set", "batch.prompts_per_rollout=4", "--set", "batch.samples_per_optimizer_step=16",
            "--set", "batch.micro_batch_size=8", "--set", "critic.warmup_steps=1"]  # fmt: skip
    a, b = run_full_and_resumed(base, tmp_path)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert a[0]["critic/warmup"] == 1.0 and "loss" not in a[0]  # step 1: the critic alone
    assert a[1]["critic/warmup"] == 0.0 and "loss" in a[1]
    for ra, rb in zip(a, b):
        for key in ("reward/mean", "critic/value_loss", "critic/grad_norm",
                    "critic/explained_variance", "critic/values_mean"):  # fmt: skip
            assert ra[key] == rb[key], (ra["step"], key, ra[key], rb[key])
        if "loss" in ra:
            assert ra["loss"] == rb["loss"] and ra["grad_norm"] == rb["grad_norm"]
    assert_same_export(tmp_path, "hf")
    critic = assert_same_export(tmp_path, "hf_critic")
    config = json.loads((tmp_path / "full" / "hf_critic" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForTokenClassification"]
    assert critic["score.weight"].shape == (1, 128)
