"""How one weight sync reaches a running vLLM engine: the bucket stream
(`unirl.core.weights.stream`), each bucket packed into one buffer by the engine-neutral
`unirl.rollouts.serving.packing`, turned into vLLM 0.32's messages, one bucket at a time.

    transport = make_transport("ipc", client=LlmClient(llm), folder=folder, device=device,
                               bucket_bytes=1 << 30)
    transport.send(buckets)        # every bucket; the engine holds the new weights after it
    transport.close()

- ``file`` (`FileTransport`): each bucket one safetensors file in tmpfs, then vLLM's in-place
  ``reload_weights`` (the CPU's transport; weights.py).
- ``ipc`` (`IpcTransport`): vLLM's ``WeightTransferConfig(backend="ipc")`` in its packed mode:
  each bucket is one uint8 GPU buffer (`pack_bucket`), shared through a CUDA IPC handle
  (``torch.multiprocessing.reductions.reduce_tensor``) keyed by the GPU's UUID, and announced
  with ``update_weights`` (names, dtype names, shapes, byte sizes); the engine's worker on the
  same GPU maps the buffer, splits it, clones each tensor and loads it
  (vllm/distributed/weight_transfer/ipc_engine.py, packed_tensor.py `packed_ipc_consumer`).
- ``nccl`` (`NcclTransport`): ``backend="nccl"``, packed with a buffer of one bucket: the
  leader announces a bucket's tensors with ``update_weights`` (on a side thread: the workers
  wait inside the broadcast) and broadcasts the bucket's packed buffer (`pack_bucket`) as rank 0
  of a group with the engine's workers (vllm/distributed/weight_transfer/nccl_engine.py).

Every sync is ``start_weight_update`` -> ``update_weights`` per bucket -> ``finish_weight_update``
(vLLM's layerwise reload then processes the loaded weights). The messages are plain data built by
`pack_bucket` / `ipc_update_info` / `nccl_update_info`, tested on the CPU against vLLM's own
unpacking; the IPC handles travel pickled (``ipc_handles_pickled``, which the engine reads with
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``: vLLM's msgpack channel carries no torch types).

Where the buckets are. Each transport says where it wants the stream's buckets
(``bucket_device``, which the rollout source hands to ``TrainingBackend.stream_weights``): the
host for ``file``, the transport's GPU for ``ipc`` and ``nccl``. A stream's bucket is one flat
buffer laid out by `unirl.core.weights.stream.packed_layout`, which is vLLM's packed layout, so
`pack_bucket` sends that buffer itself (`flat_buffer`: no copy, no staging buffer); a bucket that
is not flat (a state dict's tensors, `as_buckets`; a host bucket) is copied into a new buffer on
the GPU, in the same layout. So a GPU sync holds one bucket of GPU memory beyond the trainer's
for ``nccl`` and two for ``ipc`` (vLLM's importer keeps the previous bucket's mapping until the
next one arrives, so the freed bucket waits in torch's IPC limbo until then), plus the engine's
clone, and no weight passes through the host. The trainer side
imports torch only (no vLLM), except the NCCL group, which is vLLM's own
(`StatelessProcessGroup` + `PyNcclCommunicator`) so that both ends agree.
"""

from __future__ import annotations

import base64
import logging
import pickle
import socket
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch

from unirl.core.weights.stream import HOST, Bucket, bucketed
from unirl.rollouts.serving.packing import PackedBucket, ipc_handle_args, pack_bucket

logger = logging.getLogger(__name__)


class WeightClient(Protocol):
    """The engine's weight-update calls (vLLM's ``VLLMWeightSyncClient``, with plain dicts)."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any]) -> None: ...

    def finish_weight_update(self) -> None: ...


class LlmClient:
    """`WeightClient` over a `vllm.LLM` (its RL methods take request dicts)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self) -> None:
        self.llm.finish_weight_update()


# -- messages ----------------------------------------------------------------------------------


def ipc_update_info(packed: PackedBucket, handle_args: tuple, gpu_uuid: str) -> dict[str, Any]:
    """vLLM's packed ``IPCWeightTransferUpdateInfo`` for one bucket, as the dict
    ``update_weights`` takes; the handle pickled, keyed by the GPU's UUID."""
    handles = {gpu_uuid: handle_args}
    return {
        "names": list(packed.names),
        "dtype_names": list(packed.dtype_names),
        "shapes": [list(s) for s in packed.shapes],
        "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode("ascii"),
        "tensor_sizes": list(packed.tensor_sizes),
    }


def nccl_update_info(packed: PackedBucket) -> dict[str, Any]:
    """vLLM's ``NCCLWeightTransferUpdateInfo`` for one bucket (its tensors' metadata)."""
    return {
        "names": list(packed.names),
        "dtype_names": list(packed.dtype_names),
        "shapes": [list(s) for s in packed.shapes],
    }


def nccl_buffer_bytes(bucket_bytes: int) -> int:
    """The packed buffer size both NCCL ends agree on. vLLM's consumer cuts a bucket's
    metadata into broadcasts that close once they pass this size; a bucket holds at most
    ``bucket_bytes`` (or one larger tensor), so each bucket is exactly one broadcast."""
    return bucket_bytes


# -- transports --------------------------------------------------------------------------------


class FileTransport:
    """Safetensors in a tmpfs folder, reloaded by the engine in place (weights.py)."""

    name = "file"
    bucket_device = HOST  # safetensors are written from host memory

    def __init__(self, engine: Any, folder: Any) -> None:
        self.engine, self.folder = engine, folder

    def send(self, buckets: Iterable[Bucket]) -> None:
        self.folder.write(buckets)
        self.engine.reload_weights(str(self.folder.path))

    def close(self) -> None:
        pass


class IpcTransport:
    """CUDA IPC to an engine on this process's GPU (module docstring). Each bucket's buffer is
    kept until its ``update_weights`` returned (the engine cloned it by then)."""

    name = "ipc"

    def __init__(self, client: WeightClient, device: torch.device) -> None:
        self.client = client
        self.device = device
        self.bucket_device = device  # a stream's bucket on this GPU is shared as it is
        self.gpu_uuid = str(torch.cuda.get_device_properties(device).uuid)
        client.init_weight_transfer_engine({"packed": True})

    def send(self, buckets: Iterable[Bucket]) -> None:
        self.client.start_weight_update()
        for bucket in buckets:
            packed = pack_bucket(bucket, self.device)
            torch.cuda.current_stream(self.device).synchronize()  # the bytes are in before
            info = ipc_update_info(packed, ipc_handle_args(packed.buffer), self.gpu_uuid)
            self.client.update_weights(info)
            del packed, bucket  # the bucket freed before the next is made
        self.client.finish_weight_update()
        torch.cuda.ipc_collect()  # buffers the engine released go back to the allocator

    def close(self) -> None:
        torch.cuda.ipc_collect()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NcclTransport:
    """A packed NCCL broadcast from this (leader) process, rank 0, to the engine's
    ``tensor_parallel_size`` workers (module docstring)."""

    name = "nccl"

    def __init__(
        self, client: WeightClient, device: torch.device, *, workers: int, bucket_bytes: int
    ) -> None:
        from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

        self.client = client
        self.device = device
        self.bucket_device = device  # a stream's bucket on this GPU is broadcast as it is
        port = free_port()
        buffer = nccl_buffer_bytes(bucket_bytes)
        self.buffer_bytes = buffer
        worker_info = {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": workers + 1,
            "packed": True,
            "packed_buffer_size_bytes": buffer,
            "packed_num_buffers": 2,
        }
        # The workers wait in the rendezvous inside init_weight_transfer_engine: open ours
        # beside it.
        with ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(client.init_weight_transfer_engine, worker_info)
            self.group = stateless_init_process_group(
                "127.0.0.1", port, rank=0, world_size=workers + 1, device=device
            )
            future.result()

    def send(self, buckets: Iterable[Bucket]) -> None:
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            for bucket in self._within_buffer(buckets):
                packed = pack_bucket(bucket, self.device)
                future = pool.submit(self.client.update_weights, nccl_update_info(packed))
                self.group.broadcast(packed.buffer, src=0, stream=torch.cuda.current_stream())
                future.result()
                del packed, bucket  # the bucket freed before the next
        finally:
            # a failed broadcast leaves the engine's call waiting: do not join it
            pool.shutdown(wait=False)
        self.client.finish_weight_update()

    def _within_buffer(self, buckets: Iterable[Bucket]) -> Iterator[Bucket]:
        """``buckets``, each cut to the engine's buffer: vLLM's consumer ends a broadcast once
        its tensors pass ``packed_buffer_size_bytes``, so a larger bucket of several tensors
        (a state dict sent as one, `as_buckets`) would leave the two sides waiting on different
        broadcasts. A single tensor larger than the buffer goes alone, as vLLM expects."""
        for bucket in buckets:
            if (
                len(bucket) > 1
                and sum(t.numel() * t.element_size() for _, t in bucket) > self.buffer_bytes
            ):
                yield from bucketed(bucket, self.buffer_bytes)
            else:
                yield bucket
            del bucket

    def close(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.destroy()


def bucket_device(kind: str, device: torch.device) -> torch.device:
    """Where transport ``kind`` wants a sync's buckets, before it exists (the transports'
    ``bucket_device``): ``device`` (this rank's GPU) for ipc / nccl, the host for file."""
    return FileTransport.bucket_device if kind == FileTransport.name else device


def make_transport(
    kind: str,
    *,
    engine: Any,
    folder: Any,
    device: torch.device | None,
    workers: int,
    bucket_bytes: int,
) -> FileTransport | IpcTransport | NcclTransport:
    """The transport ``kind`` (placement.choose_transport) to the running ``engine``
    (a `VllmEngine`)."""
    if kind == "file":
        return FileTransport(engine, folder)
    assert device is not None and device.type == "cuda", "ipc / nccl run on CUDA only"
    client = LlmClient(engine.llm)
    if kind == "ipc":
        return IpcTransport(client, device)
    return NcclTransport(client, device, workers=workers, bucket_bytes=bucket_bytes)
