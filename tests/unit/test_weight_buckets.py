"""The host-memory side of the weight stream (issue 28): buckets planned from shapes and filled
in one flat buffer (`unirl.core.weights.stream.planned_buckets`), and the zero-copy safetensors
writer of the file transport (`unirl.rollouts.serving.weights.write_safetensors`), read back by
safetensors' own loader."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from unirl.core.weights import stream as weight_stream
from unirl.core.weights.stream import HOST, FlatBucket, TensorSpec, planned_buckets, same_device
from unirl.rollouts.serving.weights import write_safetensors


def _spec(name: str, t: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, tuple(t.shape), t.dtype)


def test_flat_bucket_views_are_aligned_and_disjoint():
    specs = [
        TensorSpec("a", (3,), torch.bfloat16),  # 6 bytes
        TensorSpec("b", (2, 2), torch.float32),  # 16
        TensorSpec("c", (), torch.int64),  # 8
        TensorSpec("d", (5,), torch.bool),  # 5
        TensorSpec("e", (0, 4), torch.float32),  # 0
    ]
    bucket = FlatBucket(specs)
    assert bucket.buffer.numel() == 6 + 16 + 8 + 5  # no padding
    for spec, slot in zip(specs, bucket.slots):
        assert slot.shape == spec.shape and slot.dtype == spec.dtype
        assert slot.data_ptr() % slot.element_size() == 0
    # each slot written with its own bytes; none overwrites another
    bucket.slots[0].copy_(torch.tensor([1.5, -2.0, 3.25]))
    bucket.slots[1].copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    bucket.slots[2].fill_(-7)
    bucket.slots[3].copy_(torch.tensor([True, False, True, True, False]))
    assert bucket.slots[0].tolist() == [1.5, -2.0, 3.25]
    assert bucket.slots[1].tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert bucket.slots[2].item() == -7
    assert bucket.slots[3].tolist() == [True, False, True, True, False]
    assert [n for n, _ in bucket.tensors()] == ["a", "b", "c", "d", "e"]


def test_planned_buckets_fill_by_unit_and_drop_the_previous_bucket(monkeypatch):
    # units: a fused pair ("qk": 2 tensors of 16 bytes), singles of 40, 8 and 16 bytes
    weights = {
        "e": torch.arange(10, dtype=torch.float32),  # 40 B: larger than a bucket, alone
        "q": torch.full((4,), 1.0),
        "k": torch.full((4,), 2.0),
        "n": torch.full((2,), 3.0),  # 8 B
        "m": torch.full((4,), 4.0),
    }
    units = [("e",), ("q", "k"), ("n",), ("m",)]
    calls: list[tuple[tuple[str, ...], bool]] = []
    alive: list[StorageWeakRef] = []

    def make(unit: tuple[str, ...], out: torch.Tensor | None) -> list[torch.Tensor]:
        # the consumer dropped every bucket it was given before this one is being made (freed by
        # reference count: nothing else may hold one)
        assert all(r.expired() for r in alive[:-1]), unit  # [-1]: the bucket being filled
        calls.append((unit, out is not None))
        if out is not None:  # a single tensor may be written in place
            out.copy_(weights[unit[0]])
            return [out]
        return [weights[n] for n in unit]

    class Recorded(weight_stream.FlatBucket):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            alive.append(StorageWeakRef(self.buffer.untyped_storage()))  # its one buffer's memory

    monkeypatch.setattr(weight_stream, "FlatBucket", Recorded)
    got: dict[str, torch.Tensor] = {}
    sizes = []
    stream = planned_buckets(
        units, lambda u: [_spec(n, weights[n]) for n in u], make, 24, keep=True, device=HOST
    )
    for bucket in stream:
        sizes.append([n for n, _ in bucket])
        got.update((n, t.clone()) for n, t in bucket)
        del bucket
    # 24-byte buckets: e alone (40 > 24); q; k + n (the pair cut by the boundary); m
    assert sizes == [["e"], ["q"], ["k", "n"], ["m"]]
    # every unit made once, in order; singles got their slot, the pair did not
    assert calls == [(("e",), True), (("q", "k"), False), (("n",), True), (("m",), True)]
    for name, t in weights.items():
        assert torch.equal(got[name], t), name


def test_planned_buckets_on_a_rank_that_does_not_receive():
    made = []
    stream = planned_buckets(
        [1, 2, 3],
        lambda u: [TensorSpec(str(u), (2,), torch.float32)],
        lambda u, out: made.append((u, out)) or [torch.zeros(2)],
        8,
        keep=False,
        device=HOST,
    )
    assert list(stream) == []
    assert made == [(1, None), (2, None), (3, None)]  # every gather still taken part in


def test_safetensors_written_from_a_flat_bucket_read_back_bit_for_bit(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    g = torch.Generator().manual_seed(0)
    values = {
        "w.bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "w.f32": torch.randn(4, 2, generator=g),
        "steps": torch.tensor(12345678901, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 3),
    }
    bucket = FlatBucket([_spec(n, t) for n, t in values.items()])
    for slot, t in zip(bucket.slots, values.values()):
        slot.copy_(t)
    tied = torch.randn(2, 3, generator=g)
    tensors = [
        *bucket.tensors(),
        ("embed", tied),
        ("head", tied),  # shares storage with "embed": written twice, no clone needed
        ("strided", torch.randn(4, 6, generator=g)[:, ::2]),  # not contiguous
    ]
    path = tmp_path / "b.safetensors"
    write_safetensors(path, tensors)
    back = safetensors_torch.load_file(str(path))
    assert set(back) == {n for n, _ in tensors}
    for name, t in tensors:
        assert back[name].dtype == t.dtype and back[name].shape == t.shape, name
        bits = t.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(back[name].reshape(-1).view(torch.uint8), bits), name


def test_same_device():
    assert same_device("cpu", torch.device("cpu", 0)) and same_device(HOST, "cpu")
    assert same_device("cuda:1", torch.device("cuda", 1))
    assert not same_device("cuda:1", "cuda:2") and not same_device("cpu", "cuda:0")
    assert not same_device("cpu", "meta") and same_device("meta", "meta")
