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

The weights arrive as a stream of buckets (`unirl.core.weight_stream`): each bucket is written
as its own safetensors file (``weights-00001.safetensors`` ...; vLLM loads every safetensors file
of a folder without an index), so the host never holds more than one bucket.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from unirl.core.errors import RunError
from unirl.core.weight_stream import Bucket


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
        for index, bucket in enumerate(buckets, start=1):
            name = f"weights-{index:05d}.safetensors"
            self._write_file(name, bucket)
            written.add(name)
        for stale in self.path.glob("*.safetensors"):
            if stale.name not in written:
                stale.unlink()

    def _write_file(self, name: str, bucket: Bucket) -> None:
        from safetensors.torch import save_file

        tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for key, tensor in bucket:
            t = tensor.detach().to("cpu").contiguous()
            # safetensors refuses tensors that share memory (tied embeddings): copy the second.
            if t.untyped_storage().data_ptr() in seen:
                t = t.clone()
            seen.add(t.untyped_storage().data_ptr())
            tensors[key] = t
        tmp = self.path / (name + ".tmp")
        try:
            save_file(tensors, str(tmp))
            os.replace(tmp, self.path / name)
        except OSError as exc:
            raise RunError(
                f"writing the weight sync for the vLLM engine to {self.path} failed "
                f"({exc.strerror or exc}); free space there or set rollout.vllm.sync_dir to "
                "another folder, then run again with --resume"
            ) from exc

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
