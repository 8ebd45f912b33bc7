"""Issue 28, item 1, on one process: the bucketing rule, which ranks a source's weights go to, a
file-sourced run that streams nothing (instrumented, through `unirl.train.train`), a non-finite
policy refused before its source sees a tensor, and the sampler loading a stream bucket by
bucket into exactly the weights it was given."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from unirl.core.config.run_config import load_config
from unirl.core.errors import RunError
from unirl.core.run.divergence import DivergenceGuard
from unirl.core.weight_sync import WeightSync
from unirl.core.weights.stream import HOST, MIB, NonFiniteWeightsError, bucketed, checked_stream

EXAMPLES = Path(__file__).parents[2] / "examples"


def test_buckets_keep_order_and_limit():
    # 4-byte floats: 3, 1, 5 (alone: above the 12-byte limit), 2, 1 elements
    sizes = [3, 1, 5, 2, 1]
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate(sizes)]
    buckets = list(bucketed(iter(tensors), 12))
    # by hand: t0 (12 B) -> [t0]; t1 (4 B) would make 16 -> new [t1]; t2 (20 B) -> new [t2] (alone);
    # t3 (8 B) -> new [t3]; t4 (4 B) -> 12 <= 12 -> [t3, t4]
    assert [[n for n, _ in b] for b in buckets] == [["t0"], ["t1"], ["t2"], ["t3", "t4"]]
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(bucketed(iter(tensors), 0))


class SpyBackend:
    """Records what the weight sync asks of a backend."""

    def __init__(self, bad: str | None = None) -> None:
        self.streams: list[tuple[int, int | None]] = []
        self.devices: list[torch.device] = []
        self.checks = 0
        self.bad = bad

    def non_finite_weight(self) -> str | None:
        self.checks += 1
        return self.bad

    def stream_weights(self, bucket_bytes: int, *, dst: int | None, device=HOST):
        self.streams.append((bucket_bytes, dst))
        self.devices.append(device)
        return checked_stream(self.non_finite_weight, lambda: iter([[("w", torch.ones(2))]]))


class SpySource:
    def __init__(self, device: torch.device = HOST) -> None:
        self.received: list[list[str]] = []
        self.weights_device = device

    def sync_weights(self, buckets: Any, *, policy_version: int) -> None:
        self.received.append([n for b in buckets for n, _ in b])


def _cfg(source: str, *extra: str):
    sets = [f"rollout.source={source}", *extra]
    if source == "file":
        sets.append(f"rollout.file={EXAMPLES / 'tiny_rollouts.jsonl'}")
    return load_config(EXAMPLES / "tiny_grpo.yaml", sets, world_size=1)


@pytest.mark.parametrize(
    ("source", "dst"), [("sampler", None), ("vllm", 0)], ids=["every-rank", "rank0"]
)
def test_sources_say_who_receives(source, dst):
    if source == "vllm":
        pytest.importorskip("vllm")
    backend, spy = SpyBackend(), SpySource()
    sync = WeightSync(_cfg(source, "rollout.weight_bucket_mb=3"), backend, spy)
    sync.initial(0)
    sync.after_step(1, {}, DivergenceGuard(0), 1)
    assert backend.streams == [(3 * MIB, dst), (3 * MIB, dst)]
    assert spy.received == [["w"], ["w"]]


def test_syncs_ask_for_buckets_where_the_source_wants_them():
    # a device no default spells (cpu:0 is not torch.device("cpu")): it can only arrive by
    # being passed along
    wanted = torch.device("cpu", 0)
    backend, spy = SpyBackend(), SpySource(wanted)
    sync = WeightSync(_cfg("sampler"), backend, spy)
    sync.initial(0)
    sync.after_step(1, {}, DivergenceGuard(0), 1)
    assert backend.devices == [wanted, wanted] and wanted != HOST


def test_file_source_gets_no_stream():
    backend, spy = SpyBackend(), SpySource()
    sync = WeightSync(_cfg("file"), backend, spy)
    assert sync.initial(0) == 0.0
    assert sync.after_step(1, {}, DivergenceGuard(0), 1) == 0.0
    assert backend.streams == [] and spy.received == []
    assert backend.checks == 1  # the divergence guard's check of the local shards still runs
    with pytest.raises(RunError, match=r"not finite after RL step 2 \(first in lm_head"):
        WeightSync(_cfg("file"), SpyBackend(bad="lm_head.weight"), spy).after_step(
            2, {}, DivergenceGuard(0), 2
        )


def test_non_finite_policy_reaches_no_source():
    backend, spy = SpyBackend(bad="model.layers.0.mlp.up_proj.weight"), SpySource()
    sync = WeightSync(_cfg("sampler"), backend, spy)
    with pytest.raises(RunError, match=r"RL step 3 \(first in model\.layers\.0\.mlp\.up_proj"):
        sync.after_step(3, {}, DivergenceGuard(0), 3)
    assert spy.received == []
    with pytest.raises(NonFiniteWeightsError) as err:
        backend.stream_weights(1, dst=0)
    assert err.value.parameter == "model.layers.0.mlp.up_proj.weight"


def test_file_sourced_run_streams_nothing(tmp_path, monkeypatch):
    """`unirl train --rollouts FILE` end to end in this process, with every way of
    materialising or streaming the weights instrumented: none is called during the steps."""
    pytest.importorskip("deepspeed")
    from unirl.backends.hf.backend import HFBackend
    from unirl.train import train, with_rollout_file

    calls: list[str] = []

    def forbidden(name: str):
        def call(self, *args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} called by a file-sourced run")

        return call

    monkeypatch.setattr(HFBackend, "stream_weights", forbidden("stream_weights"))
    monkeypatch.setattr(HFBackend, "hf_state_dict", forbidden("hf_state_dict"))
    # a source that checks the trainer's fit (vLLM colocated) is asked once, after step 1
    from unirl.rollouts.source import FileRolloutSource

    fit_checked_after: list[int] = []
    order: list[str] = []  # the fit check before the sync after step 1 (which wakes an engine)

    def check_trainer_fit(self) -> None:
        metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        fit_checked_after.append(len(metrics))
        order.append("fit")

    after_step = WeightSync.after_step

    def recorded_after_step(self, rl_step, *args, **kwargs):
        order.append(f"sync after step {rl_step}")
        return after_step(self, rl_step, *args, **kwargs)

    monkeypatch.setattr(FileRolloutSource, "check_trainer_fit", check_trainer_fit, raising=False)
    monkeypatch.setattr(WeightSync, "after_step", recorded_after_step)
    cfg = load_config(
        EXAMPLES / "tiny_grpo.yaml",
        [f"logging.run_dir={tmp_path / 'run'}", "logging.tensorboard=false",
         "checkpoint.export_hf=false", "progress.enabled=false"],
        world_size=1,
    )  # fmt: skip
    summary = train(with_rollout_file(cfg, str(EXAMPLES / "tiny_rollouts.jsonl")))
    assert summary.steps_done == 2  # the file's two rollouts
    assert calls == []
    assert fit_checked_after == [1]
    assert order == ["fit", "sync after step 1", "sync after step 2"]
