"""Rewards and the post-processing hook run once per rollout, on global rank 0, whatever the
number of ranks (issue 31 item 4, issue 28 item 5): with 2 ranks sampling the same rollout, a
reward that logs every call to a file is called once per rollout, every rank gets rank 0's
rewards (each the length of its response, recomputed here), and the hook runs once, its batch on
both ranks."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("transformers", reason="needs transformers (pip install unirl[hf])")

from tests.spawn import run_distributed
from tests.tiny_models import TINY_BATCH, TINY_LLAMA

PROMPTS = [
    {"prompt": f"{a}+{b}=", "metadata": {"answer": a + b}} for a, b in [(1, 2), (3, 4), (2, 2)]
]
TINY = {**TINY_LLAMA, "vocab_size": 32, "num_hidden_layers": 1}


def _rank(rank: int, world: int, prompts: str, log: str, hook_log: str) -> dict:
    import torch

    from tests.unit.worker_rewards import counted_hook
    from unirl.core.config.run_config import config_from_dict
    from unirl.rollouts import build_rollout_source
    from unirl.rollouts.postprocess import apply_postprocess_hook

    torch.set_num_threads(1)
    os.environ["UNIRL_TEST_HOOK_LOG"] = hook_log
    cfg = config_from_dict(
        {
            "model": {"hf_config": TINY, "max_seq_len": 16, "init_seed": 1},
            "batch": dict(TINY_BATCH),
            "parallel": {"world_size": world},
            "rollout": {"prompts": prompts, "reward": "tests.unit.worker_rewards:counted_length",
                        "reward_options": {"log": log}, "max_new_tokens": 4},
        }
    )  # fmt: skip
    source = build_rollout_source(cfg)
    out: dict = {"pid": os.getpid(), "rewards": [], "expected": [], "hooked": []}
    for k in range(2):
        batch = source.next_rollout(k)
        out["rewards"].append([s.reward for s in batch.samples])
        out["expected"].append([float(len(s.metadata["response"])) for s in batch.samples])
        hooked = apply_postprocess_hook(counted_hook, batch, k, "counted_hook", timeout_s=60.0)
        out["hooked"].append([s.reward for s in hooked.samples])
    source.close()
    return out


def test_rewards_and_hook_run_once_per_rollout_on_rank0(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    log, hook_log = tmp_path / "calls.txt", tmp_path / "hook.txt"
    r0, r1 = run_distributed(_rank, 2, str(prompts), str(log), str(hook_log))
    # one call per rollout, all 4 samples in it, made by rank 0
    assert log.read_text().split("\n")[:-1] == [f"4 {r0['pid']}", f"4 {r0['pid']}"]
    assert r0["rewards"] == r1["rewards"] == r0["expected"] == r1["expected"]
    assert hook_log.read_text().split("\n")[:-1] == [f"0 {r0['pid']}", f"1 {r0['pid']}"]
    assert r0["hooked"] == r1["hooked"] == [[float(r0["pid"])] * 4] * 2
