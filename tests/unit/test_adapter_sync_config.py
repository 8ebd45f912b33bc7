"""What the weight sync carries under ``model.lora``, as `unirl check` prints it in its LoRA section
(the adapter's size counted by hand below), and the sync refusing a source that cannot take an adapter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from unirl.cli import check_report
from unirl.core.config.run_config import load_config
from unirl.core.errors import ConfigError
from unirl.core.weight_sync import WeightSync

EXAMPLES = Path(__file__).parents[2] / "examples"
LORA = "model.lora={rank: 4, alpha: 8, target_modules: [q_proj, k_proj, down_proj]}"


def test_check_prints_the_adapter_only_sync_and_its_size():
    cfg = load_config(EXAMPLES / "tiny_grpo_vllm.yaml", [LORA])
    (line,) = [x for x in check_report(cfg)["lora"] if x.startswith("weight sync:")]
    # tiny_grpo_vllm: hidden 128, intermediate 256, 4 heads of 32, 2 kv heads, 2 layers;
    # rank 4 * (in + out): q 4*(128+128), k 4*(128+64), down 4*(256+128) = 1024+768+1536
    assert "the adapter only" in line and "rank 4" in line
    assert "6,656 elements, 26,624 bytes per sync" in line  # 2 layers * 3328, fp32
    assert "base weights never changed" in line


def test_check_says_no_sync_without_one(tmp_path):
    rollouts = tmp_path / "r.jsonl"
    rollouts.write_text("")
    cfg = load_config(EXAMPLES / "tiny_grpo.yaml", [LORA, "rollout.source=file",
                                                    f"rollout.file={rollouts}"])  # fmt: skip
    lines = check_report(cfg)["lora"]
    assert "weight sync: no weight sync: the source receives no weights" in lines


class _AdapterBackend:
    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        raise AssertionError("refused before any sync")

    def stream_base_weights(self, bucket_bytes: int, *, dst, device=None):
        raise AssertionError("refused before any sync")

    def export_adapter(self, path: Path) -> None:
        raise AssertionError


class _FullWeightsSource:  # sync_weights only
    def sync_weights(self, buckets, *, policy_version: int) -> None:
        raise AssertionError


def test_a_source_that_cannot_take_an_adapter_is_refused():
    cfg = load_config(EXAMPLES / "tiny_grpo.yaml", [LORA])
    with pytest.raises(ConfigError, match=r"rollout.source='sampler'.*_FullWeightsSource"):
        WeightSync(cfg, _AdapterBackend(), _FullWeightsSource())  # type: ignore[arg-type]


def test_vllm_sleep_discard_is_refused_under_lora():
    # level 2 would drop the base weights, which an adapter-only sync sends only once
    with pytest.raises(ConfigError, match=r"rollout.vllm.sleep='discard' with model.lora"):
        load_config(EXAMPLES / "tiny_grpo_vllm.yaml", [LORA, "rollout.vllm.sleep=discard"])


def test_check_says_what_generating_ahead_does_under_lora():
    # was refused (the async worker took full-weight snapshots); now each queued rollout
    # carries its version's adapter (tests/unit/test_async_lora.py proves the log-probs)
    from unirl.rollouts.check import check_rollout_config

    cfg = load_config(EXAMPLES / "tiny_grpo.yaml", [LORA, "train.max_staleness=1"])
    check_rollout_config(cfg)
    (line,) = [x for x in check_report(cfg)["lora"] if x.startswith("weight sync:")]
    assert "with train.max_staleness=1 each rollout generated ahead carries a copy of its " in line
    assert "the adapter after RL step max(0, r - 1), stamped with its policy version" in line
