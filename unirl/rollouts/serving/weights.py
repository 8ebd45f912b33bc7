"""The policy's weights as a Hugging Face folder the engine starts from and reloads.

    folder = WeightFolder.create(sync_dir=None, hf_config=config)   # under /dev/shm
    folder.write(buckets)             # one safetensors file per bucket, each replaced atomically
    engine.reload_weights(folder.path)
    folder.remove()

Why a folder, per device. vLLM's engine runs in another process; what reaches it must cross a
process boundary. On the CPU the cheapest crossing is a file in tmpfs (/dev/shm: memory, no
disk): one safetensors write (a memcpy) and vLLM's in-place ``reload_weights(weights_path=...)``,
which memory-maps it: 0.02 s on the tiny model, 1 s for 361 MB (benchmarks/README.md). The
alternative, ``collective_rpc`` with the tensors as arguments, pickles every tensor through
vLLM's message queue. On GPUs vLLM's weight-transfer engines skip the host round trip
(transport.py: CUDA IPC for an engine on the trainer's GPU, NCCL for engines on other GPUs); the
folder then holds only ``config.json`` (and the tokenizer), and this file path remains for the
CPU and for colocated engines over several GPUs.

The weights arrive as a stream of buckets (`unirl.core.weights.stream`): each bucket is written
as its own safetensors file (``weights-00001.safetensors`` ...; vLLM loads every safetensors file
of a folder without an index), written straight from the bucket's tensors (`write_safetensors`:
no serialised copy, and the views of one flat bucket need no clone), so the host never holds
more than one bucket.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from unirl.core.errors import RunError
from unirl.core.weights.stream import Bucket

# safetensors' dtype names
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_safetensors(path: str | Path, tensors: Bucket) -> None:
    """``tensors`` as one safetensors file, each tensor's bytes written from its own memory
    (a non-contiguous one is made contiguous first, alone): no serialised copy of the bucket,
    and tensors that share storage (a flat bucket's views, tied embeddings) are written as they
    are. The layout is safetensors' own: largest element size first, then by name, each
    tensor's bytes in order without holes, the header padded to 8 bytes."""
    items = sorted(tensors, key=lambda item: (-item[1].element_size(), item[0]))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in items:
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} has no safetensors name")
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for _, t in items:
            if t.numel():
                flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                f.write(memoryview(flat.numpy()))


def _default_root() -> str:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else tempfile.gettempdir()


class WeightFolder:
    """A private folder holding ``config.json`` and ``model.safetensors``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def create(cls, sync_dir: str | None, hf_config: Any) -> WeightFolder:
        """A fresh folder under ``sync_dir`` (``rollout.vllm.sync_dir``; default /dev/shm) with
        ``hf_config`` (a transformers ``PretrainedConfig``) saved in it."""
        root = sync_dir or _default_root()
        try:
            Path(root).mkdir(parents=True, exist_ok=True)
            path = Path(tempfile.mkdtemp(prefix="unirl-vllm-", dir=root))
            hf_config.save_pretrained(path)
        except OSError as exc:
            raise RunError(
                f"rollout.vllm.sync_dir={root!r}: cannot create the engine's weight folder "
                f"({exc.strerror or exc}); point rollout.vllm.sync_dir at a writable folder "
                "(a tmpfs such as /dev/shm is fastest)"
            ) from exc
        return cls(path)

    def write(self, buckets: Iterable[Bucket]) -> None:
        """Write each bucket of Hugging Face-named tensors as one safetensors file, each
        replaced by a rename so the engine never reads half a file; files a previous sync left
        beyond this one's count are removed."""
        written: set[str] = set()
        # no enumerate(): its result tuple would keep the previous bucket alive while the
        # stream makes the next one
        for bucket in buckets:
            name = f"weights-{len(written) + 1:05d}.safetensors"
            self._write_file(name, bucket)
            written.add(name)
            del bucket  # freed before the stream makes the next one
        for stale in self.path.glob("*.safetensors"):
            if stale.name not in written:
                stale.unlink()

    def _write_file(self, name: str, bucket: Bucket) -> None:
        tmp = self.path / (name + ".tmp")
        try:
            write_safetensors(tmp, bucket)
            os.replace(tmp, self.path / name)
        except OSError as exc:
            raise RunError(
                f"writing the weight sync for the vLLM engine to {self.path} failed "
                f"({exc.strerror or exc}); free space there or set rollout.vllm.sync_dir to "
                "another folder, then run again with --resume"
            ) from exc

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
