"""Pieces of the DeepSpeed backend that need no engine: the generated DeepSpeed config and the
``deepspeed.extra`` merge, the LR schedule (hand-computed values), the LR scheduler's state, and
the op-build lock with its stale-baton handling."""

from __future__ import annotations

import math
import os
import threading
import time

import pytest
import torch

from unirl.backends.deepspeed.distributed import clear_stale_baton, op_build_lock
from unirl.backends.deepspeed.engine import deepspeed_config
from unirl.backends.deepspeed.plugin import DeepSpeedOptions
from unirl.backends.hf.optim import ScheduledLR, adamw_param_groups
from unirl.core.config.run_config import (
    BatchConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    UnirlConfig,
)
from unirl.core.errors import ConfigError
from unirl.core.run.lr_schedule import check_schedule, learning_rate, lr_multiplier


def _cfg(**over) -> UnirlConfig:
    return UnirlConfig(
        model=ModelConfig(hf_config={"model_type": "llama"}, **over.pop("model", {})),
        batch=BatchConfig(
            prompts_per_rollout=2,
            samples_per_prompt=2,
            samples_per_optimizer_step=4,
            micro_batch_size=1,
        ),
        parallel=ParallelConfig(zero_stage=over.pop("stage", 2), world_size=1),
        backend_options=DeepSpeedOptions(extra=over.pop("extra", {})),
        **over,
    )


# -- DeepSpeed config ----------------------------------------------------------------------------


def test_generated_config():
    ds = deepspeed_config(
        _cfg(stage=3, model={"dtype": "bf16"}, optimizer=OptimizerConfig(grad_clip=None)), dp_size=4
    )
    assert ds["zero_optimization"] == {"stage": 3}
    assert ds["bf16"] == {"enabled": True}
    assert ds["gradient_clipping"] == 0.0  # grad_clip: null -> DeepSpeed's "off"
    # one microbatch per "DeepSpeed step": unirl accumulates itself
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (1, 1)
    assert ds["train_batch_size"] == 4


def test_one_rank_zero3_keeps_its_parameters_gathered():
    """On one rank a partition is the whole parameter: every parameter stays gathered (no
    memory cost), unless deepspeed.extra sets the threshold or offloads the parameters."""
    import sys

    one = deepspeed_config(_cfg(stage=3), dp_size=1)["zero_optimization"]
    assert one == {"stage": 3, "stage3_param_persistence_threshold": sys.maxsize}
    assert deepspeed_config(_cfg(stage=3), dp_size=2)["zero_optimization"] == {"stage": 3}
    assert deepspeed_config(_cfg(stage=2), dp_size=1)["zero_optimization"] == {"stage": 2}
    own = {"zero_optimization": {"stage3_param_persistence_threshold": 10}}
    zero = deepspeed_config(_cfg(stage=3, extra=own), dp_size=1)["zero_optimization"]
    assert zero["stage3_param_persistence_threshold"] == 10
    own = {"zero_optimization": {"param_persistence_threshold": 10}}  # the field's own name
    zero = deepspeed_config(_cfg(stage=3, extra=own), dp_size=1)["zero_optimization"]
    assert "stage3_param_persistence_threshold" not in zero
    for offload in (
        {"offload_param": {"device": "cpu"}},
        {"offload_param": {"device": "nvme", "nvme_path": "/tmp"}},
        {"cpu_offload_param": True},  # DeepSpeed's deprecated spelling
    ):
        zero = deepspeed_config(_cfg(stage=3, extra={"zero_optimization": offload}), dp_size=1)
        assert "stage3_param_persistence_threshold" not in zero["zero_optimization"], offload
    kept = {"zero_optimization": {"offload_param": {"device": "none"}}}  # no offload
    zero = deepspeed_config(_cfg(stage=3, extra=kept), dp_size=1)["zero_optimization"]
    assert zero["stage3_param_persistence_threshold"] == sys.maxsize


def test_extra_merges_recursively_but_owned_keys_are_refused():
    extra = {"zero_optimization": {"reduce_bucket_size": 1000}, "bf16": {"enabled": False}}
    ds = deepspeed_config(_cfg(stage=2, extra=extra), dp_size=1)
    # the nested key is added, the stage kept; the same value for an owned key is fine
    assert ds["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 1000}
    with pytest.raises(
        ConfigError, match=r"deepspeed\.extra\.zero_optimization\.stage=1 .* parallel\.zero_stage"
    ):
        deepspeed_config(_cfg(stage=2, extra={"zero_optimization": {"stage": 1}}), dp_size=1)
    with pytest.raises(ConfigError, match=r"deepspeed\.extra\.gradient_accumulation_steps=4"):
        deepspeed_config(_cfg(extra={"gradient_accumulation_steps": 4}), dp_size=1)
    with pytest.raises(ConfigError, match=r"deepspeed\.extra\.optimizer="):
        deepspeed_config(_cfg(extra={"optimizer": {"type": "Adam"}}), dp_size=1)


def test_weight_decay_skips_vectors():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    decay, no_decay = adamw_param_groups(model, 0.1)
    assert [tuple(p.shape) for p in decay["params"]] == [(2, 3)]
    assert sorted(tuple(p.shape) for p in no_decay["params"]) == [(2,), (2,), (2,)]
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)


# -- LR schedule -----------------------------------------------------------------------------------


def test_lr_schedule_hand_values():
    def m(schedule, s, warmup=2, total=6, r=0.2):
        return lr_multiplier(
            s, schedule=schedule, warmup_steps=warmup, total_steps=total, min_lr_ratio=r
        )

    # warmup W=2: (s+1)/W
    assert [m("cosine", s) for s in (0, 1)] == [0.5, 1.0]
    assert [m("constant", s) for s in range(6)] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    # linear, N=6, r=0.2: p = (s-2)/4; m = 0.2 + 0.8 (1-p): s=2: 1.0, s=3: 0.8, s=4: 0.6, s=5: 0.4
    assert [m("linear", s) for s in range(2, 6)] == pytest.approx([1.0, 0.8, 0.6, 0.4])
    # cosine: m = 0.2 + 0.4 (1 + cos(pi p)): s=3: 0.2 + 0.4 * 1.70710678 = 0.88284271,
    # s=4: 0.2 + 0.4 = 0.6, s=5: 0.2 + 0.4 * 0.29289322 = 0.31715729; s >= N stays at r
    assert [m("cosine", s) for s in (3, 4, 5, 6, 9)] == pytest.approx(
        [0.88284271, 0.6, 0.31715729, 0.2, 0.2]
    )
    # no warmup: the first step already decays from 1; lr = optimizer.lr * m
    assert m("linear", 0, warmup=0, total=4, r=0.0) == 1.0
    opt = OptimizerConfig(lr=0.5, lr_schedule="linear", min_lr_ratio=0.0)
    assert learning_rate(1, opt, total_steps=4) == 0.5 * 0.75
    assert math.isclose(learning_rate(2, opt, total_steps=4), 0.25)


def test_lr_schedule_errors():
    with pytest.raises(ConfigError, match="warmup_steps=5 leaves no step"):
        check_schedule(OptimizerConfig(lr_schedule="cosine", warmup_steps=5), total_steps=5)
    with pytest.raises(ConfigError, match=r"min_lr_ratio must be >= 0 and <= 1, got 1\.5"):
        check_schedule(OptimizerConfig(min_lr_ratio=1.5), total_steps=5)
    with pytest.raises(ConfigError, match="total optimizer steps=0"):
        check_schedule(OptimizerConfig(), total_steps=0)
    check_schedule(OptimizerConfig(warmup_steps=9), total_steps=5)  # constant: warmup may run long


def test_scheduler_sets_lr_and_restores_state():
    params = [torch.nn.Parameter(torch.zeros(2))]
    opt = torch.optim.AdamW(
        [{"params": params}, {"params": [torch.nn.Parameter(torch.zeros(1))]}], lr=9.0
    )
    sched = ScheduledLR(opt, lambda s: 0.1 * (s + 1))
    assert sched.get_last_lr() == pytest.approx([0.1, 0.1])  # set at construction: step 0's lr
    sched.step()
    sched.step()
    assert sched.get_last_lr() == pytest.approx([0.3, 0.3])
    fresh = ScheduledLR(opt, lambda s: 0.1 * (s + 1))
    fresh.load_state_dict(sched.state_dict())
    assert fresh.steps_done == 2 and opt.param_groups[1]["lr"] == pytest.approx(0.3)


# -- op-build lock -----------------------------------------------------------------------------------


def test_op_build_lock_is_exclusive(tmp_path):
    """A second holder (its own open file, as another process would have) waits for the first."""
    events = []

    def second():
        with op_build_lock(tmp_path):
            events.append(("second", time.monotonic()))

    with op_build_lock(tmp_path):
        thread = threading.Thread(target=second)
        thread.start()
        time.sleep(0.3)
        events.append(("first releases", time.monotonic()))
    thread.join(timeout=10)
    assert [e[0] for e in events] == ["first releases", "second"]


def test_stale_baton_is_removed_and_live_one_awaited(tmp_path):
    baton = tmp_path / "lock"
    assert clear_stale_baton(tmp_path, stale_after_s=5) is False  # none: nothing to do

    baton.touch()
    old = time.time() - 600  # left by a build killed ten minutes ago
    os.utime(baton, (old, old))
    assert clear_stale_baton(tmp_path, stale_after_s=300) is True
    assert not baton.exists()

    baton.touch()  # a live build (outside unirl) that finishes 0.2 s later: wait, do not remove
    timer = threading.Timer(0.2, baton.unlink)
    timer.start()
    start = time.monotonic()
    assert clear_stale_baton(tmp_path, stale_after_s=30) is False
    assert 0.15 < time.monotonic() - start < 5
    timer.join()


def test_one_rank_zero3_hooks_each_decoder_layer_once():
    """At dp 1 with parameters kept gathered, the classes HF's ``_no_split_modules`` names become
    DeepSpeed leaf modules (its hooks stop there); not on more ranks, with offload, when
    deepspeed.extra picks leaf modules itself, or when the model names no layer class."""
    pytest.importorskip("deepspeed", reason="needs deepspeed")
    from deepspeed.utils import z3_leaf_module

    from unirl.backends.deepspeed.engine import one_rank_leaf_layers

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def model(names=("Block",)):
        m = torch.nn.Sequential(Block(), Block(), torch.nn.Linear(4, 2))
        m._no_split_modules = list(names)
        return m

    m = model()
    assert one_rank_leaf_layers(m, 1, {}) == [m[0], m[1]]
    assert [z3_leaf_module(x) for x in (m[0], m[1], m[2], m[0].a)] == [True, True, False, False]
    offload = {"zero_optimization": {"offload_param": {"device": "cpu"}}}
    granularity = {"zero_optimization": {"stage3_module_granularity_threshold": 100}}
    own_leaves = {"zero_optimization": {"leaf_module": {"classes": ["Block"]}}}
    for dp, extra in ((2, {}), (1, offload), (1, granularity), (1, own_leaves)):
        m = model()
        assert one_rank_leaf_layers(m, dp, extra) == [], (dp, extra)
        assert not z3_leaf_module(m[0])
    assert one_rank_leaf_layers(model(), 1, {}, offloaded=True) == []
    assert one_rank_leaf_layers(model(names=()), 1, {}) == []
