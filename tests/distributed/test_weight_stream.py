"""Issue 28, item 1: the weight stream, on 2 gloo processes per layout (the contract suite's tiny
Llama). For DeepSpeed ZeRO 0 / 3, FSDP2 (full sharding, Ulysses SP) and Megatron (tp2, pp2):

- the buckets streamed to rank 0 hold exactly the full export's tensors (`hf_state_dict`, the
  path the Hugging Face folder is written from): same names, dtypes and bits; rank 1 receives
  nothing; streamed to every rank, each rank gets them all;
- no bucket is above the limit unless it is a single tensor larger than the limit;
- asked for buckets on a device (``device=``, as the IPC / NCCL transports ask for their GPU),
  every bucket rank 0 gets is a flat buffer (`flat_buffer`: what the transports send without a
  copy) made on that device, with the same tensors: the device is ``cpu:0``, which no default
  spells, so it can only have been passed down to where each backend allocates its buckets;
- a NaN in one local shard of rank 1 only is refused on every rank when the stream is asked
  for, before any bucket exists, with the parameter's name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from tests.contract import fixtures
from tests.spawn import run_distributed
from unirl.core.protocols.backend_plugin import ContractLayout

BUCKET_BYTES = 6 * 1024  # the tiny Llama's embedding (8 KiB) and MLP weights travel alone

LAYOUTS = {
    "deepspeed-zero0": ("deepspeed", ContractLayout.of("zero0-dp2", 2, zero_stage=0)),
    "deepspeed-zero3": ("deepspeed", ContractLayout.of("zero3-dp2", 2, zero_stage=3)),
    "fsdp2-full": ("fsdp2", ContractLayout.of("full-dp2", 2)),
    "fsdp2-sp": ("fsdp2", ContractLayout.of("sp2", 2, options={"sp": 2})),
    "megatron-tp2": ("megatron", ContractLayout.of("tp2", 2, tp=2)),
    "megatron-pp2": ("megatron", ContractLayout.of("pp2", 2, pp=2)),
    "megatron-dp2": ("megatron", ContractLayout.of("dp2", 2)),
}
REQUIRES = {"deepspeed": "deepspeed", "fsdp2": "torch", "megatron": "megatron.core"}


def _poison_local_shard(backend: Any, name: str) -> str:
    """Put a NaN into this rank's own shard of one MLP weight; the name the error must give."""
    if name == "megatron":
        chunk = backend.policy.chunks[0]
        layer = chunk.decoder.layers[0]
        shard = dict(chunk.named_parameters())["decoder.layers.0.mlp.linear_fc2.weight"]
        hf = f"model.layers.{layer.layer_number - 1}.mlp.down_proj.weight"
    else:
        hf = "model.layers.1.mlp.down_proj.weight"
        param = dict(backend.model.named_parameters())[hf]
        shard = getattr(param, "ds_tensor", None)  # ZeRO-3's partition
        if shard is None:
            shard = param.to_local() if hasattr(param, "to_local") else param  # FSDP2's shard
    with torch.no_grad():
        shard.view(-1)[0] = float("nan")
    return hf


# a device no default spells (torch.device("cpu") has no index): it reaches a FlatBucket only by
# being passed along
MARK = torch.device("cpu", 0)


def _stream_to_mark(
    backend: Any, backend_name: str
) -> list[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """The stream to rank 0 on ``MARK``; per bucket, whether it is one flat buffer made by a
    `FlatBucket` asked for ``MARK`` (every FlatBucket the backends make is recorded)."""
    from unirl.core.weights import stream as weight_stream

    made: dict[int, torch.device] = {}  # buffer address -> the device it was asked for

    class Recorded(weight_stream.FlatBucket):
        def __init__(self, specs: Any, device: Any = weight_stream.HOST) -> None:
            super().__init__(specs, device)
            made[self.buffer.data_ptr()] = torch.device(device)

    out = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(weight_stream, "FlatBucket", Recorded)
        if backend_name == "megatron":  # its pipeline's receive buffers
            mp.setattr("unirl.backends.megatron.weights.stream.FlatBucket", Recorded)
        for bucket in backend.stream_weights(BUCKET_BYTES, dst=0, device=MARK):
            flat = weight_stream.flat_buffer(bucket)  # checked now: addresses are reused later
            out.append((bucket, flat is not None and made.get(flat.data_ptr()) == MARK))
            del bucket, flat
    return out


@contextlib.contextmanager
def _counted_broadcasts() -> Iterator[list[str]]:
    """The object broadcasts this rank makes inside the block: under pipeline stages each bucket
    travels behind its header (the specs), so a stream to one rank that sends each bucket to it
    alone broadcasts no header (the tensor-parallel gathers broadcast tensors, never objects)."""
    import torch.distributed as dist

    calls: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        for name in ("broadcast_object_list",):
            original = getattr(dist, name)

            def counted(*args: Any, _original: Any = original, _name: str = name, **kw: Any) -> Any:
                calls.append(_name)
                return _original(*args, **kw)

            mp.setattr(dist, name, counted)
        yield calls


def _worker(rank: int, world_size: int, backend_name: str, layout: ContractLayout, model_dir: str,
            run_dir: str) -> dict[str, Any]:  # fmt: skip
    from unirl.core.config.run_config import config_from_dict
    from unirl.core.protocols.backend_plugin import build_backend
    from unirl.core.weights.stream import NonFiniteWeightsError

    data = fixtures.base_config(
        backend=backend_name,
        model_dir=model_dir,
        world_size=world_size,
        parallel=layout.parallel_dict,
        options=layout.options_dict,
        model=layout.model_dict,
        dtype="fp32",
        run_dir=run_dir,
    )
    backend = build_backend(config_from_dict(data, world_size=world_size), total_optimizer_steps=1)
    try:
        out: dict[str, Any] = {"full": backend.hf_state_dict()}
        with _counted_broadcasts() as broadcasts:
            out["to_rank0"] = list(backend.stream_weights(BUCKET_BYTES, dst=0))
        out["broadcasts_to_rank0"] = broadcasts
        out["to_rank1"] = list(backend.stream_weights(BUCKET_BYTES, dst=1))
        out["to_all"] = list(backend.stream_weights(BUCKET_BYTES, dst=None))
        out["to_rank0_on_mark"] = _stream_to_mark(backend, backend_name)
        expected = _poison_local_shard(backend, backend_name) if rank == 1 else None
        try:
            backend.stream_weights(BUCKET_BYTES, dst=0)  # refused here: no bucket is ever made
            out["refused"] = None
        except NonFiniteWeightsError as exc:
            out["refused"] = exc.parameter
        out["poisoned"] = expected
        return out
    finally:
        backend.close()


def _check_buckets(buckets: list[list[tuple[str, torch.Tensor]]]) -> None:
    assert len(buckets) > 1
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= BUCKET_BYTES or len(bucket) == 1, [(n, tuple(t.shape)) for n, t in bucket]


def _same_tensors(buckets: list[list[tuple[str, torch.Tensor]]], full: dict) -> None:
    names = [n for b in buckets for n, _ in b]
    assert len(names) == len(set(names)), "a tensor was streamed twice"
    assert set(names) == set(full)
    for bucket in buckets:
        for name, tensor in bucket:
            assert tensor.device.type == "cpu"
            assert tensor.dtype == full[name].dtype and tensor.shape == full[name].shape, name
            assert torch.equal(tensor, full[name]), name


# one layout per backend in the default tier; the other three in the slow tier (tests/conftest.py)
SLOW = {"deepspeed-zero0", "fsdp2-sp"}


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=[pytest.mark.slow] if c in SLOW else []) for c in sorted(LAYOUTS)],
)
def test_stream_equals_full_export(case, tmp_path):
    backend_name, layout = LAYOUTS[case]
    pytest.importorskip(REQUIRES[backend_name])
    model_dir = fixtures.write_tiny_model(tmp_path / "tiny")
    ranks = run_distributed(
        _worker, 2, backend_name, layout, str(model_dir), str(tmp_path / "run"), timeout=400
    )
    full = ranks[0]["full"]
    for rank, out in enumerate(ranks):
        for name, tensor in full.items():  # the export is the same on every rank
            assert torch.equal(out["full"][name], tensor), (rank, name)
        _same_tensors(out["to_all"], full)
        _check_buckets(out["to_all"])
    _same_tensors(ranks[0]["to_rank0"], full)
    _check_buckets(ranks[0]["to_rank0"])
    assert ranks[1]["to_rank0"] == []  # rank 1 only took part in the gathers
    _same_tensors(ranks[1]["to_rank1"], full)
    assert ranks[0]["to_rank1"] == []
    if backend_name == "megatron":  # its pipeline stages send to the receiving rank alone
        assert ranks[0]["broadcasts_to_rank0"] == ranks[1]["broadcasts_to_rank0"] == []
    marked = ranks[0]["to_rank0_on_mark"]
    assert marked and all(flat for _, flat in marked)
    _same_tensors([bucket for bucket, _ in marked], full)
    assert ranks[1]["to_rank0_on_mark"] == []
    poisoned = ranks[1]["poisoned"]
    for out in ranks:
        assert out["refused"] is not None and poisoned in out["refused"], out["refused"]


def _fsdp2_paths(rank: int, world_size: int) -> dict[str, Any]:
    """A module with an odd and an even dim 0 under `fully_shard` (gloo), streamed in bf16 to
    rank 0 on ``MARK``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from unirl.backends.fsdp2.weight_stream import stream_weights

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 6, bias=False))
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    cpu = torch.device("cpu")
    buckets = list(stream_weights(model, torch.bfloat16, cpu, 40, dst=0, device=MARK))
    return {"before": before, "buckets": buckets}


def test_fsdp2_stream_casts_uneven_and_even_shards_into_the_bucket(tmp_path):
    """The device path of the FSDP2 stream, on the CPU: a parameter whose dim 0 does not split
    evenly (3 rows on 2 ranks) is gathered whole (``full_tensor``) and cast by its copy into
    the bf16 slot, as on a GPU; an even one (6 rows) is gathered rank by rank, then cast. Both
    equal the weights before sharding, cast to bf16 by plain torch."""
    ranks = run_distributed(_fsdp2_paths, 2, timeout=200)
    before = ranks[0]["before"]
    got = {n: t for bucket in ranks[0]["buckets"] for n, t in bucket}
    assert set(got) == set(before) == {"0.weight", "0.bias", "1.weight"}
    for name, tensor in before.items():
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name], tensor.to(torch.bfloat16)), name
    assert ranks[1]["buckets"] == []
