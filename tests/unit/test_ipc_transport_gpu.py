"""The CUDA IPC weight transport (`unirl.rollouts.vllm.transport.IpcTransport`) on a real GPU,
against a receiver process written here that reads the messages the way vLLM 0.32's IPC engine
does (vllm/distributed/weight_transfer/ipc_engine.py, packed mode, and packed_tensor.py
`packed_ipc_consumer`): the handle unpickled from ``ipc_handles_pickled``, looked up by its own
GPU's UUID, the device index (argument 6) replaced by its own, ``rebuild_cuda_tensor``, the
content cut by ``tensor_sizes`` and viewed by dtype name and shape. It rebuilds the expected
tensors from the seed itself and compares bit for bit, over two syncs (the second after the
first's buffers were released). vLLM cannot be installed on the GPU machine, so the engine side
is this receiver.

A real backend's stream too (FSDP2 and Megatron, one GPU, an 11.5M-parameter Llama in bf16):
``stream_weights(device=cuda)``, as the vLLM source asks for it, sent by `IpcTransport`, arrives
equal bit for bit to the backend's full export (``hf_state_dict``, saved for the receiver);
every bucket is a flat GPU buffer that the transport shares as it is (its handle is the
bucket's own memory), and the sync's peak GPU memory above the trainer's stays within two of the
largest buckets (the engine keeps the previous one mapped, as vLLM's importer does) plus an fp32 copy of the largest tensor (one gathered parameter before its cast
into the bucket) plus 1 MiB of slack (the model is 3x that).

    PYTHONPATH=$PWD python -m pytest -q -m gpu tests/unit/test_ipc_transport_gpu.py
"""

from __future__ import annotations

import base64
import pickle
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

SEED = 7
SYNCS = 2


def make_buckets(seed: int, sync: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Three buckets of mixed dtypes and shapes, on the CPU (as the weight stream yields them);
    the same on both sides of the test."""
    g = torch.Generator().manual_seed(seed * 100 + sync)
    shapes = [
        [("model.embed_tokens.weight", (1000, 64), torch.bfloat16),
         ("model.layers.0.input_layernorm.weight", (63,), torch.float32)],
        [("model.layers.0.self_attn.q_proj.weight", (64, 64), torch.bfloat16),
         ("model.layers.0.self_attn.q_proj.bias", (7,), torch.bfloat16),
         ("model.layers.0.mlp.gate.e_score_correction_bias", (5,), torch.float32),
         ("model.layers.0.mlp.experts.0.down_proj.weight", (3, 1, 5), torch.float16)],
        [("lm_head.weight", (1000, 64), torch.bfloat16)],
    ]  # fmt: skip
    return [
        [(name, torch.randn(shape, generator=g).to(dtype)) for name, shape, dtype in bucket]
        for bucket in shapes
    ]


def _receive(inbox: Any, outbox: Any, seed: int, expected_path: str | None = None) -> None:
    """The engine's side: rebuild every announced bucket and compare it with the expected one
    (``make_buckets(seed, sync)``, or the state dict saved at ``expected_path``)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    torch.cuda.set_device(0)
    device_index = torch.cuda.current_device()
    uuid = str(torch.cuda.get_device_properties(device_index).uuid)
    problems: list[str] = []
    received = 0
    sync = -1
    held: list[torch.Tensor] = []  # the mapping kept, as vLLM keeps it
    while True:
        kind, info = inbox.get()
        if kind == "init":
            if info != {"packed": True}:
                problems.append(f"init info {info}")
        elif kind == "start":
            sync += 1
            if expected_path is None:
                expected = {n: t for b in make_buckets(seed, sync) for n, t in b}
            else:
                expected = torch.load(expected_path)
        elif kind == "update":
            handles = pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))
            args = list(handles[uuid])
            args[6] = device_index
            buffer = rebuild_cuda_tensor(*args)
            offset = 0
            for name, shape, dtype_name, size in zip(
                info["names"], info["shapes"], info["dtype_names"], info["tensor_sizes"]
            ):
                raw = buffer[offset : offset + size]
                offset += size
                got = raw.view(getattr(torch, dtype_name)).view(shape).clone().cpu()
                want = expected.pop(name)
                if got.dtype != want.dtype or not torch.equal(got, want):
                    problems.append(f"sync {sync}: {name} differs")
                received += 1
            # vLLM's importer keeps the last bucket's mapping until the next one arrives (or
            # the update finishes): so the sender's freed bucket stays allocated until then
            held[:] = [buffer]
            del buffer, raw
        elif kind == "finish":
            held.clear()
            if expected:
                problems.append(f"sync {sync}: never received {sorted(expected)}")
        elif kind == "stop":
            outbox.put((received, problems))
            return
        outbox.put("ack")


class QueueClient:
    """The trainer's `WeightClient`: each call goes to the receiver and returns once it
    answered (vLLM's ``collective_rpc`` returns when every worker has run the call)."""

    def __init__(self, inbox: Any, outbox: Any) -> None:
        self.inbox, self.outbox = inbox, outbox

    def _call(self, kind: str, info: Any = None) -> None:
        self.inbox.put((kind, info))
        assert self.outbox.get(timeout=60) == "ack"

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._call("init", init_info)

    def start_weight_update(self) -> None:
        self._call("start")

    def update_weights(self, update_info: dict) -> None:
        self._call("update", update_info)

    def finish_weight_update(self) -> None:
        self._call("finish")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA IPC)")
def test_ipc_transport_to_a_receiver_process_bit_for_bit():
    import torch.multiprocessing as mp

    from unirl.rollouts.vllm.transport import IpcTransport

    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    receiver = ctx.Process(target=_receive, args=(inbox, outbox, SEED), daemon=True)
    receiver.start()
    try:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        transport = IpcTransport(QueueClient(inbox, outbox), device)
        before = torch.cuda.memory_allocated(device)
        for sync in range(SYNCS):
            transport.send(iter(make_buckets(SEED, sync)))
        transport.close()
        inbox.put(("stop", None))
        received, problems = outbox.get(timeout=60)
        receiver.join(timeout=30)
    finally:
        if receiver.is_alive():
            receiver.kill()
    assert problems == []
    assert received == SYNCS * sum(len(b) for b in make_buckets(SEED, 0))
    # the buffers the receiver released went back: nothing of the syncs stays allocated
    assert torch.cuda.memory_allocated(device) == before


# -- a real backend's stream, on the GPU -----------------------------------------------------

# 11.5M parameters (bf16: 22 MiB); the largest tensors (embedding, head): 2 MiB bf16, 4 MiB fp32
MODEL = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
STREAM_BUCKET = 1 << 20  # 1 MiB: about 20 buckets; the embedding and head travel alone
MIB = 1 << 20


def _backend_sync(rank: int, world_size: int, backend_name: str, tmp: str) -> dict[str, Any]:
    """In a fresh process with an NCCL group of one: build the backend, save its full export
    for the receiver, then stream to ``device=cuda`` through `IpcTransport`."""
    import torch.multiprocessing as mp
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.contract import fixtures
    from unirl.core.config.run_config import config_from_dict
    from unirl.core.protocols.backend_plugin import build_backend
    from unirl.core.weights.stream import flat_buffer
    from unirl.rollouts.vllm import transport as transport_module
    from unirl.rollouts.vllm.transport import IpcTransport

    torch.manual_seed(0)
    model_dir = f"{tmp}/model"
    LlamaForCausalLM(LlamaConfig(**MODEL, initializer_range=0.02)).save_pretrained(model_dir)
    data = fixtures.base_config(
        backend=backend_name, model_dir=model_dir, world_size=1, parallel={}, dtype="bf16",
        run_dir=f"{tmp}/run",
    )  # fmt: skip
    backend = build_backend(config_from_dict(data, world_size=1), total_optimizer_steps=1)
    device = torch.device("cuda", torch.cuda.current_device())
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    receiver = None
    try:
        expected = backend.hf_state_dict()
        torch.save(expected, f"{tmp}/expected.pt")
        receiver = ctx.Process(
            target=_receive, args=(inbox, outbox, SEED, f"{tmp}/expected.pt"), daemon=True
        )
        receiver.start()
        shared: list[int] = []
        handle_args = transport_module.ipc_handle_args

        def recording(buffer: torch.Tensor) -> tuple:
            shared.append(buffer.data_ptr())
            return handle_args(buffer)

        transport_module.ipc_handle_args = recording
        flat: list[tuple[int | None, int]] = []  # per bucket: its flat buffer's address, bytes

        def watched(stream: Any) -> Any:
            for bucket in stream:
                buffer = flat_buffer(bucket)
                on_gpu = buffer is not None and buffer.device == device
                flat.append(
                    (buffer.data_ptr() if on_gpu else None, buffer.numel() if on_gpu else 0)
                )
                del buffer
                yield bucket
                del bucket  # held by nothing while the next bucket is made

        transport = IpcTransport(QueueClient(inbox, outbox), device)
        torch.cuda.synchronize()
        own = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        transport.send(watched(backend.stream_weights(STREAM_BUCKET, dst=0, device=device)))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(device) - own
        transport.close()
        inbox.put(("stop", None))
        received, problems = outbox.get(timeout=120)
        receiver.join(timeout=30)
    finally:
        if receiver is not None and receiver.is_alive():
            receiver.kill()
        backend.close()
    sizes = {n: t.numel() * t.element_size() for n, t in expected.items()}
    return {
        "problems": problems,
        "received": received,
        "tensors": len(expected),
        "flat": flat,
        "shared": shared,
        "peak": peak,
        "model_bytes": sum(sizes.values()),
        "largest_fp32": max(t.numel() for t in expected.values()) * 4,
    }


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA IPC)")
@pytest.mark.parametrize("backend_name", ["fsdp2", "megatron"])
def test_a_backend_stream_on_the_gpu_arrives_bit_for_bit(backend_name, tmp_path):
    pytest.importorskip("transformers")
    if backend_name == "megatron":
        pytest.importorskip("megatron.core")
    from tests.spawn import run_distributed

    [out] = run_distributed(
        _backend_sync, 1, backend_name, str(tmp_path), backend="nccl", timeout=500
    )
    assert out["problems"] == []
    assert out["received"] == out["tensors"]  # every tensor of the export, once
    # every bucket a flat buffer on the GPU, and that very memory is what the handle shared
    assert out["flat"] and all(address is not None for address, _ in out["flat"])
    assert out["shared"] == [address for address, _ in out["flat"]]
    largest_bucket = max(size for _, size in out["flat"])
    # two buckets: the one being made and the previous, still mapped by the engine
    bound = 2 * largest_bucket + out["largest_fp32"] + MIB
    assert out["peak"] <= bound, (out["peak"] / MIB, bound / MIB)
    assert bound < out["model_bytes"] / 2  # the bound is not "the model"
