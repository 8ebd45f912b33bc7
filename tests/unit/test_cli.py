import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from unirl.cli import main

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_check_every_example(path, capsys, tmp_path):
    model_path = (yaml.safe_load(path.read_text()).get("model") or {}).get("path")
    overrides = []
    if model_path is not None and not Path(model_path).is_dir():
        # An example for real weights names a placeholder folder: check refuses it, as train
        # does, and passes once model.path is a folder here.
        assert main(["check", str(path)]) == 2
        assert f"model.path={model_path!r} is not a directory" in capsys.readouterr().err
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
        overrides = ["--set", f"model.path={tmp_path}"]
    assert main(["check", str(path), *overrides]) == 0
    out = capsys.readouterr().out
    for section in (
        "# resolved config",
        "# layout",
        "# microbatch plan",
        "# old-log-prob decision",
    ):
        assert section in out
    assert "old log-probs:" in out


def test_check_leads_with_the_decisions_and_marks_what_the_user_set(capsys):
    """The resolved config (150+ lines) came first and showed nothing of what the user set."""
    tiny = next(p for p in EXAMPLES if p.name == "tiny_grpo.yaml")
    assert main(["check", str(tiny), "--set", "algorithm.clip_high=0.3"]) == 0
    out = capsys.readouterr().out
    assert out.index("# old-log-prob decision") < out.index("# resolved config")
    config = out[out.index("# resolved config") :].splitlines()
    assert "  clip_high: 0.3  # set" in config  # from --set
    assert "  lr: 0.0005  # set" in config  # from the file
    assert "  weight_decay: 0.0" in config  # the default, unmarked
    assert "  betas: [0.9, 0.999]" in config


def test_check_json_explains_the_decision(capsys):
    tiny = next(p for p in EXAMPLES if p.name == "tiny_grpo.yaml")
    # 16 prompts x 8 samples = 128, in 2 optimizer steps of 64 -> recompute
    argv = ["check", str(tiny), "--json", "--set", "batch.samples_per_optimizer_step=64"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["plan"]["optimizer_steps_per_rollout"] == 2
    assert report["old_logprobs"]["source"] == "recompute"
    assert [n["feature"] for n in report["old_logprobs"]["needs"]] == ["multiple_optimizer_steps"]
    assert (
        report["layout"]["dp"] == 1
        and report["config"]["batch"]["samples_per_optimizer_step"] == 64
    )


def test_check_world_size(capsys):
    tiny = next(p for p in EXAMPLES if p.name == "tiny_grpo.yaml")
    assert main(["check", str(tiny), "--json", "--world-size", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    # 128 samples per step over dp 2 = 64 per rank, micro batch 32 -> 2 microbatches
    assert report["layout"]["dp"] == 2
    assert report["plan"]["microbatches_per_step_per_rank"] == 2


def test_bad_config_exits_2_naming_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "backend: deepspeed\nmodel: {hf_config: {}}\nbatch: {micro_batch_size: 1}\nalgorithm: {clip_lo: 0.1}\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "unirl.cli", "check", str(bad)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "unknown key 'algorithm.clip_lo' (did you mean 'clip_low'?)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_deepspeed_launcher_local_rank_argument_is_accepted(capsys):
    # `deepspeed unirl train ...` runs `unirl --local_rank=0 train ...`
    tiny = next(p for p in EXAMPLES if p.name == "tiny_grpo.yaml")
    assert main(["--local_rank=0", "check", str(tiny), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"]["backend"] == "deepspeed"


@pytest.mark.parametrize(
    ("overrides", "in_head", "words"),
    [
        ([], False, "model.fused_head: auto, "),
        (["model.fused_head=false"], False, "model.fused_head: false; logits from the LM head"),
        (
            ["model.fused_head=true", "backend=megatron"],
            True,
            "loss inside the fused head (3 head matmuls)",
        ),
        (
            ["model.fused_head=true", "backend=megatron", "algorithm.policy_loss=gspo"],
            False,
            "(4 head matmuls): policy_loss 'gspo' is not separable",
        ),
    ],
)
def test_check_reports_the_head_path(overrides, in_head, words, capsys):
    """`unirl check` says how the LM head meets the loss: GSPO's sequence ratio couples a
    sequence's tokens, so it cannot take the loss into the head's token chunks; PPO-clip can."""
    tiny = next(p for p in EXAMPLES if p.name == "tiny_grpo.yaml")
    argv = ["check", str(tiny), "--json"] + [a for o in overrides for a in ("--set", o)]
    assert main(argv) == 0
    head = json.loads(capsys.readouterr().out)["head"]
    assert head["loss_in_head"] is in_head and words in head["reason"], head
    assert main(["check", str(tiny)] + [a for o in overrides for a in ("--set", o)]) == 0
    assert "# LM head and loss\n" + head["reason"] in capsys.readouterr().out


@pytest.mark.parametrize(
    ("env", "sets", "words"),
    [
        (None, ["model.max_seq_len=512"], "flash varlen for every pack on a GPU: no sequence"),
        (None, ["model.max_seq_len=65536"], "(model.max_seq_len 65,536 allows them) on cuDNN"),
        ("off", ["model.max_seq_len=65536"], "every pack on a GPU (UNIRL_CUDNN_ATTENTION=off)"),
        (None, ["model.max_seq_len=65536", "model.dtype=fp32"], "without flash or cuDNN"),
    ],
)
def test_check_reports_the_attention_kernel(env, sets, words, capsys, monkeypatch):
    """`unirl check` says which kernel long sequences' attention takes on a GPU: cuDNN from
    8,192 tokens in bf16 (unirl/backends/cudnn_attention.py) unless turned off; fp32 neither."""
    if env is None:
        monkeypatch.delenv("UNIRL_CUDNN_ATTENTION", raising=False)
    else:
        monkeypatch.setenv("UNIRL_CUDNN_ATTENTION", env)
    tiny = next(p for p in EXAMPLES if p.name == "tiny_grpo.yaml")
    argv = ["check", str(tiny)] + [a for s in ["model.dtype=bf16", *sets] for a in ("--set", s)]
    assert main([*argv, "--json"]) == 0
    note = json.loads(capsys.readouterr().out)["attention"]
    assert words in note, note
    assert main(argv) == 0
    assert "# attention\n" + note in capsys.readouterr().out
