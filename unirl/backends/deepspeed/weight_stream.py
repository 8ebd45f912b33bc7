"""A DeepSpeed-trained policy's weights as a stream of buckets (`unirl.core.weight_stream`).

Under ZeRO 0-2 every rank holds the whole 16/32-bit module, so the receiving rank copies its own
parameters bucket by bucket and the others do nothing. Under ZeRO-3 the parameters are gathered
one module at a time (``deepspeed.zero.GatheredParameters``, collective), copied to the CPU on
the receiving rank(s), and released before the next module: no rank holds more than one gathered
module on the device and one bucket on the host. Names, order-independent values and dtypes are
those of `unirl.backends.deepspeed.export.hf_state_dict`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from unirl.core.weight_stream import (
    WeightBuckets,
    agree_non_finite,
    bucketed,
    checked_stream,
    first_non_finite_local,
    receives,
)


def _local_shard(param: torch.nn.Parameter) -> torch.Tensor:
    """This rank's part of ``param``: ZeRO-3's partition, else the parameter itself."""
    return param.ds_tensor if hasattr(param, "ds_tensor") else param


def non_finite_weight(engine: Any) -> str | None:
    local = first_non_finite_local(
        (n, _local_shard(p).detach()) for n, p in engine.module.named_parameters()
    )
    return agree_non_finite(local, torch.device(engine.device))


def _zero3_tensors(module: torch.nn.Module, keep: bool) -> Iterator[tuple[str, torch.Tensor]]:
    import deepspeed

    def visit(mod: torch.nn.Module, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
        params = list(mod.parameters(recurse=False))
        copies: list[tuple[str, torch.Tensor]] = []
        if params:
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                if keep:
                    copies = [
                        (prefix + n, p.detach().to("cpu", copy=True))
                        for n, p in mod.named_parameters(recurse=False)
                    ]
        yield from copies
        for name, buf in mod.named_buffers(recurse=False):
            if keep and name not in mod._non_persistent_buffers_set:
                yield prefix + name, buf.detach().to("cpu", copy=True)
        for name, child in mod.named_children():
            yield from visit(child, f"{prefix}{name}.")

    yield from visit(module, "")


def stream_weights(engine: Any, bucket_bytes: int, *, dst: int | None) -> WeightBuckets:
    """See `unirl.core.backend.TrainingBackend.stream_weights`."""
    keep = receives(dst)

    def make() -> WeightBuckets:
        module = engine.module
        if engine.zero_optimization_stage() == 3:
            tensors = _zero3_tensors(module, keep)
        elif keep:
            # the module's own state dict order; one CPU copy at a time, as the buckets fill
            tensors = ((k, v.detach().to("cpu", copy=True)) for k, v in module.state_dict().items())
        else:
            return iter(())
        return bucketed(tensors, bucket_bytes)

    return checked_stream(lambda: non_finite_weight(engine), make)
