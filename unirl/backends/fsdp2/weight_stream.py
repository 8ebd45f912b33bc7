"""An FSDP2-trained policy's weights as a stream of buckets (`unirl.core.weight_stream`).

One parameter is materialised at a time: its DTensor's ``full_tensor()`` (an all-gather over the
shard mesh, every rank), cast to the model's dtype on the device, copied to the CPU on the
receiving rank(s) and dropped. So the device holds one full parameter beyond the shards (not the
full fp32 model `get_model_state_dict` gathers), the host one bucket. Names, values and dtypes
are those of `unirl.backends.fsdp2.export.hf_state_dict`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor

from unirl.core.weight_stream import (
    WeightBuckets,
    agree_non_finite,
    bucketed,
    checked_stream,
    first_non_finite_local,
    receives,
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


def _tensors(
    model: torch.nn.Module, dtype: torch.dtype, keep: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, value in model.state_dict().items():
        full = _full(value.detach())
        if keep:
            cast = dtype if full.is_floating_point() else full.dtype
            yield name, full.to(cast).to("cpu", copy=True)
        del full


def stream_weights(
    model: torch.nn.Module,
    dtype: torch.dtype,
    device: torch.device,
    bucket_bytes: int,
    *,
    dst: int | None,
) -> WeightBuckets:
    """See `unirl.core.backend.TrainingBackend.stream_weights`."""
    keep = receives(dst)
    return checked_stream(
        lambda: non_finite_weight(model, device),
        lambda: bucketed(_tensors(model, dtype, keep), bucket_bytes),
    )
