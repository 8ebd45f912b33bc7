"""A bucket of the weight stream (`unirl.core.weights.stream`) as one flat byte buffer and the
metadata a receiver needs to cut it up again: what every transport that sends GPU memory to a
serving engine puts into its messages (vLLM's packed IPC and NCCL updates, `unirl.rollouts.vllm
.transport`; an SGLang plug-in's tensor updates likewise). Torch only, no engine.

A stream's bucket is already one flat buffer laid out by `unirl.core.weights.stream.packed_layout`
(each tensor's bytes, contiguous and row-major, back to back, widest element first), so
`pack_bucket` sends that buffer itself (`flat_buffer`: no copy); a bucket that is not flat (a
state dict's tensors, `as_buckets`; a host bucket) is copied into a new buffer in the same
layout. `ipc_handle_args` is what maps such a buffer in another process on the same GPU.
"""

from __future__ import annotations

import attrs
import torch

from unirl.core.weights.stream import Bucket, flat_buffer, packed_layout, same_device, spec_of


@attrs.frozen
class PackedBucket:
    """A bucket as one flat uint8 buffer (the tensors' bytes back to back, in order) and what
    the receiver needs to cut it up again."""

    buffer: torch.Tensor  # uint8, 1-D
    names: list[str]
    shapes: list[list[int]]
    dtype_names: list[str]  # torch attribute names: "bfloat16", "float32", ...
    tensor_sizes: list[int]  # bytes of each tensor


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pack_bucket(bucket: Bucket, device: torch.device | str) -> PackedBucket:
    """``bucket`` as one buffer on ``device`` in vLLM's packed layout (each tensor's bytes,
    contiguous and row-major, back to back in the order of the names sent:
    `unirl.core.weights.stream.packed_layout`, widest element first). A stream's bucket already
    is that buffer on ``device`` (`flat_buffer`): it is sent as it is, no byte copied. Any other
    bucket is copied into a new buffer, in the same layout."""
    specs = [spec_of(n, t) for n, t in bucket]
    layout = packed_layout(specs)
    buffer = flat_buffer(bucket)
    if buffer is None or not same_device(buffer.device, device):
        buffer = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
        for (_, t), offset, spec in zip(bucket, layout.offsets, specs):
            flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
            buffer[offset : offset + spec.nbytes].copy_(flat, non_blocking=True)
    ordered = [specs[i] for i in layout.order]
    return PackedBucket(
        buffer=buffer,
        names=[s.name for s in ordered],
        shapes=[list(s.shape) for s in ordered],
        dtype_names=[dtype_name(s.dtype) for s in ordered],
        tensor_sizes=[s.nbytes for s in ordered],
    )


def ipc_handle_args(buffer: torch.Tensor) -> tuple:
    """The arguments of ``rebuild_cuda_tensor`` that map ``buffer`` in another process."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buffer)
    return args
