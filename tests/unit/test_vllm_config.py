"""``rollout.source: vllm`` without an engine: its config section, what ``unirl check`` says about
it, the per-sample seeds, and the max-reduced mismatch metric (vLLM itself is not needed)."""

import json
from pathlib import Path

import pytest
import torch

from unirl.cli import main
from unirl.core.config.run_config import load_config
from unirl.core.errors import ConfigError
from unirl.core.maths.losses.aggregation import token_max_metric
from unirl.core.maths.losses.metrics import reduce_metrics
from unirl.rollouts.vllm import sample_seed
from unirl.rollouts.vllm.plugin import engine_settings

EXAMPLE = Path(__file__).parents[2] / "examples" / "tiny_grpo_vllm.yaml"


def test_example_section_defaults():
    cfg = load_config(EXAMPLE)
    assert cfg.rollout.source == "vllm"
    v = cfg.rollout.source_options
    assert (v.dtype, v.enforce_eager, v.tensor_parallel_size, v.max_model_len) == (
        "model", "auto", 1, None,
    )  # fmt: skip


def test_engine_defaults_follow_the_hardware():
    """auto: the CPU's small fixed cache and eager mode on the CPU; vLLM's own cache sizing and
    CUDA graphs on a GPU (the CPU values there held ~15 sequences of 600 tokens, eager); a value
    set in the config wins on both, and `unirl check` says which applies."""
    v = load_config(EXAMPLE).rollout.source_options
    cpu, gpu = engine_settings(v, cuda=False), engine_settings(v, cuda=True)
    assert (cpu.kv_cache_gb, cpu.enforce_eager) == (0.25, True)
    assert (gpu.kv_cache_gb, gpu.enforce_eager) == (None, False)
    assert "auto, the defaults for a GPU" in gpu.reason
    set_ = load_config(EXAMPLE, ["rollout.vllm.kv_cache_gb=2", "rollout.vllm.enforce_eager=true"])
    on_gpu = engine_settings(set_.rollout.source_options, cuda=True)
    assert (on_gpu.kv_cache_gb, on_gpu.enforce_eager, on_gpu.reason) == (2.0, True, "as set")
    no_cache = load_config(EXAMPLE, ["rollout.vllm.kv_cache_gb=null"]).rollout.source_options
    assert engine_settings(no_cache, cuda=False).kv_cache_gb is None


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("rollout.vllm.kv_cache_gb=0", "rollout.vllm.kv_cache_gb"),
        ("rollout.vllm.kv_cache_gb=.nan", "rollout.vllm.kv_cache_gb"),
        ("rollout.vllm.tensor_parallel_size=0", "rollout.vllm.tensor_parallel_size"),
        ("rollout.vllm.dtype=fp16", "rollout.vllm.dtype"),
        ("rollout.vllm.max_model_len=65", "model.max_seq_len=64"),
        ("rollout.vllm.kv_cache=1", "did you mean 'kv_cache_gb'"),
        (
            ["rollout.vllm.sleep=offload", "train.max_staleness=1"],
            "rollout.vllm.sleep='offload' with train.max_staleness=1: rollouts generated ahead",
        ),
    ],
)
def test_bad_engine_options_name_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("'", "'")):
        load_config(EXAMPLE, override if isinstance(override, list) else [override])


def test_check_prints_the_engine_and_the_old_logprob_source(capsys):
    assert main(["check", str(EXAMPLE), "--json", "--set", "rollout.temperature=0.7"]) == 0
    report = json.loads(capsys.readouterr().out)
    r = report["rollout"]
    assert r["source"] == "vllm" and r["dtype"] == "fp32" and r["max_model_len"] == 64
    assert "temperature 0.7" in r["rollout_logprobs"]
    assert "rank 0" in r["engine"]
    assert r["kv_cache_gb"].startswith("auto: 0.25 GiB on a CPU engine, vLLM's own sizing")
    assert r["enforce_eager"] == "auto: eager on the CPU, CUDA graphs on a GPU"
    assert report["old_logprobs"]["source"] == "reuse"


def test_sample_seeds_are_fixed_and_distinct():
    seeds = {sample_seed(1, r, i) for r in range(4) for i in range(128)}
    assert len(seeds) == 4 * 128
    assert sample_seed(1, 2, 3) == sample_seed(1, 2, 3) != sample_seed(2, 2, 3)
    assert all(0 <= s < 2**31 for s in seeds)


def test_max_metric_reduces_by_max_over_microbatches():
    # microbatch 1: |diff| 0.1, 0.7 (masked out), 0.3 -> 0.3; microbatch 2: 0.2 -> max 0.3
    mb1 = token_max_metric(torch.tensor([0.1, 0.7, 0.3]), torch.tensor([1, 0, 1]))
    mb2 = token_max_metric(torch.tensor([0.2]), torch.tensor([1]))
    empty = token_max_metric(torch.tensor([0.9]), torch.tensor([0]))
    got = reduce_metrics([{"m_max": mb1}, {"m_max": mb2}, {"m_max": empty}])
    assert got == {"m_max": pytest.approx(0.3)}
    assert reduce_metrics([{"m_max": empty}]) == {"m_max": 0.0}


def test_async_on_several_trainer_processes_is_accepted():
    # the rollout worker runs its collectives on a group of its own (rollouts/collectives.py)
    cfg = load_config(EXAMPLE, ["train.max_staleness=1"], world_size=2)
    assert cfg.train.max_staleness == 1


def test_check_with_max_staleness_prints_roles_and_the_decoupled_default(capsys):
    assert main(["check", str(EXAMPLE), "--json", "--set", "train.max_staleness=1"]) == 0
    report = json.loads(capsys.readouterr().out)["old_logprobs"]
    assert report["source"] == "recompute"  # stale samples: the proximal pass runs
    assert [n["feature"] for n in report["needs"]] == ["stale_samples"]
    assert report["roles"]["proximal"].startswith("a forward-only pass")
    # algorithm.decoupled: auto turns decoupled PPO on for k > 0, so nothing warns
    assert report["decoupled"]["on"] is True
    assert "decoupled PPO: on (auto: train.max_staleness=1" in report["explanation"]
    assert "weights the loss through decoupled PPO (auto" in report["roles"]["behaviour"]
    assert report["staleness_warning"] is None
    forced_off = ["--set", "train.max_staleness=1", "--set", "algorithm.decoupled=false"]
    assert main(["check", str(EXAMPLE), "--json", *forced_off]) == 0
    report = json.loads(capsys.readouterr().out)["old_logprobs"]
    assert report["decoupled"] == {"on": False, "reason": "algorithm.decoupled: false"}
    assert "set algorithm.decoupled: true or auto" in report["staleness_warning"]
