"""The CUDA IPC weight transport (`unirl.rollouts.vllm.transport.IpcTransport`) on a real GPU,
against a receiver process written here that reads the messages the way vLLM 0.32's IPC engine
does (vllm/distributed/weight_transfer/ipc_engine.py, packed mode, and packed_tensor.py
`packed_ipc_consumer`): the handle unpickled from ``ipc_handles_pickled``, looked up by its own
GPU's UUID, the device index (argument 6) replaced by its own, ``rebuild_cuda_tensor``, the
content cut by ``tensor_sizes`` and viewed by dtype name and shape. It rebuilds the expected
tensors from the seed itself and compares bit for bit, over two syncs (the second after the
first's buffers were released). vLLM cannot be installed on the GPU machine, so the engine side
is this receiver.

    PYTHONPATH=$PWD python -m pytest -q tests/unit/test_ipc_transport_gpu.py
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


def _receive(inbox: Any, outbox: Any, seed: int) -> None:
    """The engine's side: rebuild every announced bucket and compare it with the expected one."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    torch.cuda.set_device(0)
    device_index = torch.cuda.current_device()
    uuid = str(torch.cuda.get_device_properties(device_index).uuid)
    problems: list[str] = []
    received = 0
    sync = -1
    while True:
        kind, info = inbox.get()
        if kind == "init":
            if info != {"packed": True}:
                problems.append(f"init info {info}")
        elif kind == "start":
            sync += 1
            expected = {n: t for b in make_buckets(seed, sync) for n, t in b}
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
            del buffer, raw
        elif kind == "finish":
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
