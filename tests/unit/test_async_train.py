"""Asynchronous training (``train.max_staleness: k``): the generation schedule, the copy of the
weights the worker generates from, the metrics, and an exact resume through the CLI."""

from __future__ import annotations

import gc
import math
import threading
import time
import weakref
from typing import Any

import pytest
import torch

from tests.unit.test_train import (
    EXAMPLES,
    assert_same_export,
    run_full_and_resumed,
)
from unirl.core.data.rollout import RolloutBatch
from unirl.core.data.sample import RolloutSample
from unirl.core.errors import ConfigError
from unirl.core.mismatch import mismatch_by_staleness
from unirl.rollouts.async_source import (
    AdapterRolloutsAhead,
    RolloutsAhead,
    restore,
    staleness_metrics,
)
from unirl.rollouts.collectives import rollout_group
from unirl.rollouts.source import MeasuresRollouts


class _RecordingSource:
    """Makes a one-sample rollout whose reward is the synced weight's value, and logs calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.weight = None
        self.version = -1
        self.drawn = 0

    def sync_weights(self, buckets, *, policy_version: int) -> None:
        self.calls.append(("sync", policy_version))
        state_dict = {name: t for bucket in buckets for name, t in bucket}
        self.weight, self.version = float(state_dict["w"]), policy_version

    def next_rollout(self, rl_step: int, progress: Any = None) -> RolloutBatch:
        self.calls.append(("generate", rl_step))
        self.drawn += 1
        return RolloutBatch([RolloutSample(prompt_tokens=[1], response_tokens=[2],
                                           reward=self.weight, group_id=rl_step,
                                           policy_version=self.version)])  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return {"drawn": self.drawn}

    def load_state_dict(self, state) -> None:
        self.drawn = state["drawn"]

    def close(self) -> None:
        self.calls.append(("close", -1))


def test_worker_generates_in_order_from_the_weights_it_was_given():
    source = _RecordingSource()
    ahead = RolloutsAhead(source, max_staleness=1)
    w = torch.tensor(1.0)  # the trainer's parameter; a sync hands over a copy (the stream's bucket)
    try:
        ahead.submit(0, {"w": w.clone()}, 0)
        ahead.submit(1, {"w": w.clone()}, 0)
        w.add_(10.0)  # the trainer moves on: the queued rollouts keep the weights they were given
        first, _ = ahead.take(0)
        ahead.submit(2, {"w": w.clone()}, 1)
        second, _ = ahead.take(1)
        third, _ = ahead.take(2)
    finally:
        ahead.close()
    assert [float(g.batch.rewards[0]) for g in (first, second, third)] == [1.0, 1.0, 11.0]
    assert source.calls == [("sync", 0), ("generate", 0), ("sync", 0), ("generate", 1),
                            ("sync", 1), ("generate", 2), ("close", -1)]  # fmt: skip


def test_no_copy_of_the_weights_and_each_released_once_synced():
    """The sync's buckets are the consumer's own memory: the wrapped source gets those very
    tensors (the wrapper used to clone them per queued rollout: k + 2 copies of the model per
    rank), and once the rollouts queued from them have synced them, nothing in the wrapper keeps
    them alive."""
    seen: list[int] = []

    class Keeping(_RecordingSource):
        def sync_weights(self, buckets, *, policy_version: int) -> None:
            buckets = list(buckets)
            seen.extend(t.data_ptr() for bucket in buckets for _, t in bucket)
            super().sync_weights(buckets, policy_version=policy_version)

    ahead = RolloutsAhead(Keeping(), max_staleness=1)
    try:
        w0 = torch.tensor(1.0)
        alive = weakref.ref(w0)
        ahead.sync_weights([[("w", w0)]], policy_version=0)
        ahead.next_rollout(0)  # rollouts 0 and 1 from W_0
        assert seen and set(seen) == {w0.data_ptr()}
        w1 = torch.tensor(2.0)
        ahead.sync_weights([[("w", w1)]], policy_version=1)
        ahead.next_rollout(1)  # rollout 1 (W_0) taken, rollout 2 queued from W_1
        del w0
        gc.collect()
        assert alive() is None, "the wrapper still holds W_0 after every rollout synced it"
    finally:
        ahead.close()


def test_as_a_source_it_follows_the_schedule_of_the_loop():
    """The loop syncs W_j then asks for rollout j: k = 1 queues rollouts 0 and 1 from W_0 at
    the first call, then j + 1 from W_j; rollout r comes from W_max(0, r - 1). The metrics say
    how stale each is; close stops the worker, then closes the wrapped source."""
    source = _RecordingSource()
    ahead = RolloutsAhead(source, max_staleness=1)
    rewards, stale = [], []
    try:
        for j in range(3):
            w = torch.tensor(float(j + 1))  # W_j, the trainer's; the stream hands over a copy
            ahead.sync_weights([[("w", w.clone())]], policy_version=j)
            batch = ahead.next_rollout(j)
            w.add_(100.0)  # the trainer's step: the weights in flight keep what they were given
            rewards.append(float(batch.rewards[0]))
            stale.append(ahead.rollout_metrics()["rollout/staleness_max"])
            assert ahead.rollout_metrics()["time/rollout_wait_s"] >= 0
        assert sorted(ahead.state_dict()["in_flight"]) == ["3"]  # queued past the last step
    finally:
        ahead.close()
    assert rewards == [1.0, 1.0, 2.0] and stale == [0.0, 1.0, 1.0]
    assert source.calls == [("sync", 0), ("generate", 0), ("sync", 0), ("generate", 1),
                            ("sync", 1), ("generate", 2), ("sync", 2), ("generate", 3),
                            ("close", -1)]  # fmt: skip
    assert isinstance(ahead, MeasuresRollouts)


def test_the_snapshot_reaches_the_source_in_buckets_of_the_sync_size():
    """A transport's buffers are sized by ``rollout.weight_bucket_mb``: the copy the worker
    syncs goes in buckets of at most that size (a tensor larger than it alone), not as one."""

    class Buckets(_RecordingSource):
        def sync_weights(self, buckets, *, policy_version: int) -> None:
            self.sizes = [[name for name, _ in bucket] for bucket in buckets]

        def next_rollout(self, rl_step: int, progress: Any = None) -> RolloutBatch:
            return RolloutBatch([RolloutSample(prompt_tokens=[1], response_tokens=[2], reward=0.0,
                                               group_id=rl_step, policy_version=0)])  # fmt: skip

    source = Buckets()
    # fp32: 16 + 16 bytes fit a 40-byte bucket, the next 16 do not; 64 bytes travel alone
    weights = {"a": torch.zeros(4), "b": torch.zeros(4), "c": torch.zeros(4), "d": torch.zeros(16)}
    ahead = RolloutsAhead(source, max_staleness=1, bucket_bytes=40)
    try:
        ahead.submit(0, weights, 0)
        ahead.take(0)
    finally:
        ahead.close()
    assert source.sizes == [["a", "b"], ["c"], ["d"]]


def test_the_worker_thread_alone_sees_its_rollout_group(monkeypatch):
    """A source called in the worker gets the workers' group, the trainer's thread the default
    one (None), and close destroys the group (tests/distributed/test_async_ranks runs a real
    group on two ranks)."""
    import unirl.rollouts.async_source as async_source

    group, destroyed, seen = object(), [], []
    monkeypatch.setattr(async_source, "new_rollout_group", lambda: group)
    monkeypatch.setattr(async_source.dist, "destroy_process_group", destroyed.append)

    class Asking(_RecordingSource):
        def next_rollout(self, rl_step: int, progress: Any = None) -> RolloutBatch:
            seen.append(rollout_group())
            return super().next_rollout(rl_step, progress)

    ahead = RolloutsAhead(Asking(), max_staleness=1)
    try:
        ahead.submit(0, {"w": torch.tensor(1.0)}, 0)
        ahead.take(0)
    finally:
        ahead.close()
    assert seen == [group] and rollout_group() is None and destroyed == [group]


def test_state_round_trips_the_rollouts_in_flight():
    source = _RecordingSource()
    ahead = RolloutsAhead(source, max_staleness=2)
    ahead.submit(5, {"w": torch.tensor(3.0)}, 4)
    ahead.submit(6, {"w": torch.tensor(4.0)}, 5)
    state = ahead.state_dict()
    ahead.close()
    assert state["source"] == {"drawn": 2} and sorted(state["in_flight"]) == ["5", "6"]
    again = RolloutsAhead(_RecordingSource(), max_staleness=2)
    restore(again, state)
    assert again.source.drawn == 2 and again.has(5) and again.has(6)
    batch = again.take(6)[0].batch
    again.close()
    assert float(batch.rewards[0]) == 4.0 and batch.samples[0].policy_version == 5
    with pytest.raises(ConfigError, match=r"resume with the train\.max_staleness"):
        restore(_RecordingSource(), state)


def test_staleness_metrics_per_sample():
    batch = RolloutBatch([RolloutSample(prompt_tokens=[1], response_tokens=[2], reward=0.0,
                                        group_id=0, policy_version=v) for v in (3, 4, 4, None)])  # fmt: skip
    # ages 5-3, 5-4, 5-4 (None is left out): mean 4/3, max 2
    assert staleness_metrics(batch, 5) == {
        "rollout/staleness_mean": pytest.approx(4 / 3),
        "rollout/staleness_max": 2.0,
    }


def test_mismatch_split_by_staleness_by_hand():
    proximal = torch.tensor([[-1.0, -2.0], [-0.5, 0.0], [-1.0, -1.0], [-3.0, 0.0]])
    behaviour = torch.tensor([[-1.5, -2.0], [-0.3, 0.0], [-2.0, -1.0], [-1.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 0], [1, 0]])  # padding / loss-masked tokens: 0
    got = mismatch_by_staleness(proximal, behaviour, mask, [0, 1, 1, None])  # None: left out

    def k3(p: float, b: float) -> float:  # KL(behaviour || proximal) per token, k3
        return math.exp(p - b) - (p - b) - 1

    assert got.keys() == {f"mismatch/staleness_{s}/{m}" for s in (0, 1)
                          for m in ("abs_diff", "kl", "tokens")}  # fmt: skip
    # staleness 0: sample 0, tokens (-1 vs -1.5) and (-2 vs -2)
    assert got["mismatch/staleness_0/tokens"] == 2
    assert got["mismatch/staleness_0/abs_diff"] == pytest.approx((0.5 + 0.0) / 2)
    assert got["mismatch/staleness_0/kl"] == pytest.approx((k3(-1, -1.5) + 0.0) / 2)
    # staleness 1: sample 1's first token (-0.5 vs -0.3), sample 2's first (-1 vs -2)
    assert got["mismatch/staleness_1/tokens"] == 2
    assert got["mismatch/staleness_1/abs_diff"] == pytest.approx((0.2 + 1.0) / 2)
    assert got["mismatch/staleness_1/kl"] == pytest.approx((k3(-0.5, -0.3) + k3(-1, -2)) / 2)


def test_async_run_follows_the_schedule_and_resumes_exactly(tmp_path):
    """k = 1: rollout r (0-based) comes from the weights after max(0, r - 1) RL steps (one
    optimizer step each); a run cut at step 2 and resumed equals the uninterrupted run.
    algorithm.decoupled is left at auto: on for k > 0 (decoupled_weight_mean is logged)."""
    base = [str(EXAMPLES / "tiny_grpo.yaml"), "--set", "logging.tensorboard=false",
            "--set", "batch.prompts_per_rollout=4", "--set", "batch.samples_per_optimizer_step=32",
            "--set", "train.max_staleness=1"]  # fmt: skip
    a, b = run_full_and_resumed(base, tmp_path)
    assert [r["rollout/policy_version"] for r in a] == [0, 0, 1, 2]  # max(0, r - 1)
    assert [r["rollout/staleness_max"] for r in a] == [0, 1, 1, 1]
    assert [r["old_logprobs/source"] for r in a] == ["reuse", "recompute", "recompute", "recompute"]
    for key in ("time/overlap_s", "time/rollout_wait_s", "time/generator_idle_s"):
        assert all(r[key] >= 0 for r in a), key
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        for key in ("reward/mean", "loss", "grad_norm", "entropy", "ppo_kl",
                    "decoupled_weight_mean", "rollout/policy_version"):  # fmt: skip
            assert ra[key] == rb[key], (ra["step"], key, ra[key], rb[key])
    assert_same_export(tmp_path, "hf")


class _Blocking(_RecordingSource):
    """A generation that runs until the source is closed (an engine killed mid-generation), or
    20 s at most."""

    def __init__(self) -> None:
        super().__init__()
        self.stop = threading.Event()

    def next_rollout(self, rl_step: int, progress: Any = None) -> RolloutBatch:
        self.stop.wait(20)
        return super().next_rollout(rl_step, progress)

    def close(self) -> None:
        self.stop.set()
        super().close()


def test_close_on_a_failure_does_not_wait_for_the_generation_in_flight():
    """A run that fails while the worker generates: close stops the engine (the source) first
    and returns, instead of waiting for the generation to run to its end (up to the generation
    timeout)."""
    source = _Blocking()
    ahead = RolloutsAhead(source, max_staleness=1)
    ahead.submit(0, {"w": torch.tensor(1.0)}, 0)
    time.sleep(0.2)  # the worker is inside the generation
    closer = threading.Thread(target=ahead.close)
    t0 = time.monotonic()
    closer.start()
    closer.join(timeout=10)
    assert not closer.is_alive() and time.monotonic() - t0 < 10
    assert ("close", -1) in source.calls


def test_the_source_is_closed_even_when_stopping_the_worker_raises(monkeypatch):
    source = _RecordingSource()
    ahead = RolloutsAhead(source, max_staleness=1)

    def broken(**_: Any) -> None:
        raise RuntimeError("the pool would not stop")

    monkeypatch.setattr(ahead._pool, "shutdown", broken)
    with pytest.raises(RuntimeError, match="would not stop"):
        ahead.close()
    assert source.calls[-1] == ("close", -1)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "adapter"])
def test_only_the_ranks_that_lead_an_engine_keep_a_snapshot(monkeypatch, lora):
    """Several vLLM engines: every rank receives the stream, only the engines' leaders send it
    on, so only they keep the weights for the rollouts ahead. 2 engines on 4 ranks lead from
    ranks 0 and 2 (`placement.leaders`): those two hold a snapshot (the source gets both
    tensors), ranks 1 and 3 run the stream to its end and hold nothing (the tensors are freed
    when the sync returns). Under model.lora (`AdapterRolloutsAhead`) the same for the base
    weights, which only the first rollout queued carries."""
    import types

    from unirl.rollouts.vllm import source as vllm_source

    class Counting(_RecordingSource):
        def __init__(self, rank: int) -> None:
            super().__init__()
            self.rank, self.received = rank, []

        def uses_weights_here(self) -> bool:  # vLLM's own answer, for this rank of 4
            monkeypatch.setattr(vllm_source, "world", lambda: (self.rank, 4))
            return vllm_source.VllmRolloutSource.uses_weights_here(types.SimpleNamespace(engines=2))

        def sync_weights(self, buckets, *, policy_version: int) -> None:
            names = [name for bucket in buckets for name, _ in bucket]
            self.received.append(len(names))
            self.weight, self.version = 0.0, policy_version

        def sync_adapter(self, adapter, *, policy_version: int) -> None:
            self.version = policy_version

    snapshots, freed, streamed = [], [], []
    for rank in range(4):
        source = Counting(rank)
        ahead = (AdapterRolloutsAhead if lora else RolloutsAhead)(source, max_staleness=1)
        sent, refs = [], []

        def stream(sent=sent, refs=refs):  # the stream's own buckets: no one else holds them
            for name, size in (("w", 3), ("b", 2)):
                tensor = torch.ones(size)
                refs.append(weakref.ref(tensor))
                sent.append(name)
                yield [(name, tensor)]

        try:
            ahead.sync_weights(stream(), policy_version=0)
            gc.collect()
            freed.append(all(ref() is None for ref in refs))
            if lora:
                ahead.sync_adapter({"lora_A": torch.zeros(1)}, policy_version=0)
            ahead.next_rollout(0)  # rollouts 0 and 1 from W_0
            ahead.take(1)
        finally:
            ahead.close()
        snapshots.append(sum(1 for n in source.received if n))
        streamed.append(sent)
    # two rollouts synced from a snapshot (under LoRA the base with the first only), on leaders
    assert snapshots == ([1, 0, 1, 0] if lora else [2, 0, 2, 0])
    assert freed == [False, True, False, True]
    assert streamed == [["w", "b"]] * 4  # every rank ran the stream to its end
