"""A DeepSpeed-trained policy's weights as a stream of buckets (`unirl.core.weights.stream`).

Under ZeRO 0-2 every rank holds the whole 16/32-bit module, so the receiving rank copies its own
parameters into each bucket and the others do nothing. Under ZeRO-3 the parameters are gathered
one at a time and copied into their place in the bucket on the receiving rank(s); the buckets are
planned from the parameters' full shapes (``ds_shape``) before anything is gathered. On a GPU the
gather is DeepSpeed's (``deepspeed.zero.GatheredParameters``, on the device, released before the
next parameter). On the CPU, where the "device" is host memory too, the partitions (``ds_tensor``:
rank r holds elements [r * n, (r + 1) * n) of the flattened parameter) are all-gathered straight
into the bucket, so no second host copy of a parameter exists. The buckets are on the ``device``
the consumer asks for (the GPU for the IPC / NCCL transports: each gathered parameter is then
copied device to device into its place; the host for the file transport). No rank holds more
than one gathered parameter and one bucket. Names, values and dtypes are those of
`unirl.backends.deepspeed.export.hf_state_dict`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist

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


def _local_shard(param: torch.nn.Parameter) -> torch.Tensor:
    """This rank's part of ``param``: ZeRO-3's partition, else the parameter itself."""
    return param.ds_tensor if hasattr(param, "ds_tensor") else param


def non_finite_weight(engine: Any) -> str | None:
    local = first_non_finite_local(
        (n, _local_shard(p).detach()) for n, p in engine.module.named_parameters()
    )
    return agree_non_finite(local, torch.device(engine.device))


@attrs.frozen(eq=False)
class _Unit:
    """One exported tensor: a ZeRO-3 parameter (``partitioned``) or a tensor held whole."""

    name: str
    tensor: torch.Tensor
    partitioned: bool

    def spec(self) -> TensorSpec:
        shape = self.tensor.ds_shape if self.partitioned else self.tensor.shape
        return TensorSpec(self.name, tuple(shape), self.tensor.dtype)


def _zero3_units(module: torch.nn.Module) -> Iterator[_Unit]:
    """The export's tensors in its order: each module's parameters, then its persistent
    buffers, then its children."""
    for name, param in module.named_parameters(recurse=False):
        yield _Unit(name, param, True)
    for name, buf in module.named_buffers(recurse=False):
        if name not in module._non_persistent_buffers_set:
            yield _Unit(name, buf, False)
    for child_name, child in module.named_children():
        for unit in _zero3_units(child):
            yield attrs.evolve(unit, name=f"{child_name}.{unit.name}")


def _gather_into(param: Any, out: torch.Tensor | None) -> torch.Tensor:
    """``param`` whole, all-gathered from the ZeRO-3 partitions on the CPU, into ``out`` when it
    is given and no padding is in the way (collective over the parameter's group)."""
    group = param.ds_process_group
    shard = param.ds_tensor.detach().reshape(-1)
    world = dist.get_world_size(group)
    numel = int(param.ds_numel)
    fits = shard.numel() * world == numel
    if (
        out is not None
        and fits
        and out.dtype == shard.dtype
        and same_device(out.device, shard.device)
    ):
        flat = out.view(-1)
    else:
        flat = torch.empty(shard.numel() * world, dtype=shard.dtype, device=shard.device)
    gather_rows(flat, shard, group)
    return flat[:numel].view(param.ds_shape)


def _make(cpu: bool) -> Any:
    def make(unit: _Unit, out: torch.Tensor | None) -> Sequence[torch.Tensor]:
        if not unit.partitioned:
            return [unit.tensor.detach()]
        if cpu:
            return [_gather_into(unit.tensor, out)]
        import deepspeed

        with deepspeed.zero.GatheredParameters([unit.tensor], modifier_rank=None):
            if out is None:
                return []
            out.copy_(unit.tensor.detach())
            return [out]

    return make


def stream_weights(
    engine: Any, bucket_bytes: int, *, dst: int | None, device: torch.device
) -> WeightBuckets:
    """See `unirl.core.backend.TrainingBackend.stream_weights`."""
    keep = receives(dst)

    def make() -> WeightBuckets:
        module = engine.module
        if engine.zero_optimization_stage() == 3:
            cpu = torch.device(engine.device).type == "cpu"
            return planned_buckets(
                _zero3_units(module),
                lambda u: [u.spec()],
                _make(cpu),
                bucket_bytes,
                keep=keep,
                device=device,
            )
        if not keep:
            return iter(())
        # the module's own state dict order, each tensor copied into its bucket
        units = [_Unit(k, v.detach(), False) for k, v in module.state_dict().items()]
        return planned_buckets(
            units, lambda u: [u.spec()], _make(False), bucket_bytes, keep=True, device=device
        )

    return checked_stream(lambda: non_finite_weight(engine), make)
