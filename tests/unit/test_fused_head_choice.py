"""``model.fused_head: auto`` (`unirl.core.config.head_memory`): the plain head's logits and their
gradient per rank, computed by hand here, against ``model.fused_head_logits_gib``; the choice
flips where those bytes cross the budget, follows tp / cp / micro_batch_size, and is the one the
backends build (`derived.fused_head`) and `unirl check` prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from unirl.core.config.derived import fused_head, head_path
from unirl.core.config.head_memory import choose_fused_head
from unirl.core.config.run_config import load_config

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny_grpo.yaml"

# Qwen3's vocabulary at 16,384 tokens in bf16: logits + gradient =
# 2 x 16,384 x 151,936 x 2 bytes = 9,957,277,696 bytes = 9.2735 GiB (9,957,277,696 / 2**30)
QWEN3 = [
    "model.hf_config.vocab_size=151936",
    "model.dtype=bf16",
    "batch.micro_batch_size=null",
    "batch.max_tokens_per_microbatch=16384",
]
BYTES_16K = 9_957_277_696


def _cfg(*overrides: str):
    return load_config(TINY, [*QWEN3, *overrides])


def test_the_choice_flips_where_the_logits_cross_the_budget():
    below = choose_fused_head(_cfg("model.fused_head_logits_gib=9.28"))
    above = choose_fused_head(_cfg("model.fused_head_logits_gib=9.27"))
    assert below.logits_bytes == above.logits_bytes == BYTES_16K
    assert not below.fused and "plain head" in below.reason and "9.27 GiB" in below.reason
    assert above.fused and "fused head" in above.reason
    # the default budget (10 GiB) keeps 16k tokens on the plain head; 32k tokens (18.5 GiB) fuse
    assert not fused_head(_cfg())
    assert fused_head(_cfg("batch.max_tokens_per_microbatch=32768"))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        # tensor parallel holds 151,936 / 2 = 75,968 vocabulary rows per rank
        (["parallel.tp=2", "backend=megatron", "parallel.world_size=2"], BYTES_16K // 2),
        # context parallel holds 16,384 / 2 tokens per rank
        (["parallel.cp=2", "backend=megatron", "parallel.world_size=2"], BYTES_16K // 2),
        # no token budget: micro_batch_size x max_seq_len = 2 x 8,192 tokens
        (
            [
                "batch.max_tokens_per_microbatch=null",
                "batch.micro_batch_size=2",
                "model.max_seq_len=8192",
                "model.hf_config.max_position_embeddings=8192",
            ],
            BYTES_16K,
        ),
        # fp32: twice the bytes
        (["model.dtype=fp32"], 2 * BYTES_16K),
    ],
)
def test_the_bytes_follow_the_layout(overrides, expected):
    choice = choose_fused_head(_cfg("model.fused_head_logits_gib=9.27", *overrides))
    assert choice.logits_bytes == expected
    assert choice.fused is (expected > 9.27 * 2**30)


def test_true_and_false_force_the_head_whatever_the_bytes():
    forced_on = _cfg("model.fused_head=true", "batch.max_tokens_per_microbatch=64")
    forced_off = _cfg("model.fused_head=false", "batch.max_tokens_per_microbatch=1048576")
    assert fused_head(forced_on) and not fused_head(forced_off)
    assert head_path(forced_off).reason.startswith("model.fused_head: false")


def test_the_chosen_head_takes_the_loss_inside_when_it_is_separable():
    path = head_path(_cfg("batch.max_tokens_per_microbatch=65536", "backend=megatron"))
    assert path.loss_in_head
    assert "above model.fused_head_logits_gib=10" in path.reason
    assert "3 head matmuls" in path.reason
