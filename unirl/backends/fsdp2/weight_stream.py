"""An FSDP2-trained policy's weights as a stream of buckets (`unirl.core.weights.stream`).

One parameter is materialised at a time: its DTensor's ``full_tensor()`` (an all-gather over the
shard mesh, every rank), copied into its place in the bucket on the receiving rank(s), cast to
the model's dtype on the device, and dropped. The buckets are planned from the DTensors' global
shapes before anything is gathered, on the ``device`` the consumer asks for. A parameter evenly
sharded on dim 0 of a one-dimensional mesh (FSDP2's layout) is all-gathered straight into its
bucket slot when the slot is on the shards' device and no cast is needed (on the CPU, where the
"device" is host memory, also into a buffer of its own when it is not, since gloo's all-gather
would stage a second copy). With the bucket on the GPU (the IPC / NCCL transports) an fp32
parameter is gathered whole on the GPU and cast by its copy into the bf16 slot: nothing of it
reaches the host. So the device holds one full parameter beyond the shards (not the full fp32
model `get_model_state_dict` gathers) plus, for a GPU bucket, the bucket; the host holds one
bucket for a host bucket, nothing otherwise. Names, values and dtypes are those of
`unirl.backends.fsdp2.export.hf_state_dict`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor, Shard

from unirl.core.weights.stream import (
    TensorSpec,
    WeightBuckets,
    agree_non_finite,
    checked_stream,
    first_non_finite_local,
    gather_rows,
    planned_buckets,
    receives,
    same_device,
)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def non_finite_weight(model: torch.nn.Module, device: torch.device) -> str | None:
    local = first_non_finite_local((n, _local(p).detach()) for n, p in model.named_parameters())
    return agree_non_finite(local, device)


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (collective for a DTensor); shards offloaded to the CPU
    travel through the mesh's device, as `get_model_state_dict` moves them."""
    if not isinstance(t, DTensor):
        return t
    if t.device.type != t.device_mesh.device_type:
        t = t.to(t.device_mesh.device_type)
    return t.full_tensor()


def _evenly_sharded(t: torch.Tensor) -> bool:
    """Whether ``t``'s shards can be all-gathered straight into one tensor: dim 0 split in equal
    parts over a 1-D mesh whose device holds the shards (decided from global facts only, the
    same on every rank)."""
    if not isinstance(t, DTensor) or t.device_mesh.ndim != 1:
        return False
    if t.device.type != t.device_mesh.device_type or tuple(t.placements) != (Shard(0),):
        return False
    return t.dim() > 0 and t.shape[0] % t.device_mesh.size() == 0


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    return dtype if t.is_floating_point() else t.dtype


def stream_weights(
    model: torch.nn.Module,
    dtype: torch.dtype,
    model_device: torch.device,
    bucket_bytes: int,
    *,
    dst: int | None,
    device: torch.device,
) -> WeightBuckets:
    """See `unirl.core.backend.TrainingBackend.stream_weights` (``model_device``: the trainer's
    device, of the non-finite flag's all-reduce)."""
    keep = receives(dst)

    def spec(item: tuple[str, torch.Tensor]) -> list[TensorSpec]:
        name, value = item
        return [TensorSpec(name, tuple(value.shape), _cast(value, dtype))]

    def make(item: tuple[str, torch.Tensor], out: torch.Tensor | None) -> Sequence[torch.Tensor]:
        value = item[1].detach()
        if _evenly_sharded(value):
            local = value.to_local().contiguous()
            # the branch (the collective) is chosen from facts equal on every rank; only where
            # the gather lands differs (the receiving rank's slot, or a tensor of its own)
            if local.dtype == _cast(value, dtype) or local.device.type == "cpu":
                into = (
                    out
                    if out is not None
                    and out.dtype == local.dtype
                    and same_device(out.device, local.device)
                    else local.new_empty(tuple(value.shape))
                )
                gather_rows(into, local, value.device_mesh.get_group())
                return [into]  # not the slot: cast / moved into it by the copy
        whole = _full(value)
        if out is not None and same_device(out.device, whole.device):
            out.copy_(whole)  # cast into the slot on the device: no second gathered copy
            return [out]
        if not keep:
            return [whole]  # this rank only took part in the gather
        # cast on the device: a device -> host copy that also casts stages the whole fp32
        # parameter in host memory first
        return [whole.to(_cast(value, dtype))]

    def make_stream() -> WeightBuckets:
        items = list(model.state_dict().items())
        return planned_buckets(items, spec, make, bucket_bytes, keep=keep, device=device)

    return checked_stream(lambda: non_finite_weight(model, model_device), make_stream)
