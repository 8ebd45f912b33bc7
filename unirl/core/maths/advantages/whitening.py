"""Masked whitening over a batch that may be split across ranks.

``(x - mean) / sqrt(var + epsilon)`` where mean and var are over the valid entries of *all*
ranks of ``group``: each rank contributes ``[sum, sum of squares, count]`` to a single
all-reduce, so the result equals whitening the concatenated batch on one process. Pass the
group over which ranks hold *disjoint* entries (DP x CP when CP ranks hold different tokens; DP
alone when every CP rank holds copies of the same sequences). Without a group the statistics are
local.

The variance is unbiased (``n - 1``), as in verl's ``masked_whiten``; statistics are accumulated
in fp64 so that ``sum_sq - sum * mean`` does not cancel on large batches.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    *,
    group: Any = None,
    shift_mean: bool = True,
    epsilon: float = 1e-8,
) -> torch.Tensor:
    """Whitened ``x``, zero outside ``mask``; ``shift_mean=False`` keeps the original mean
    (only rescales). With ``group``, every rank of it must call this (one collective)."""
    valid = mask.bool()
    x64 = torch.where(valid, x.double(), 0.0)
    stats = torch.stack([x64.sum(), x64.square().sum(), valid.sum().double()])
    if group is not None:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
    total, total_sq, count = stats.unbind()
    mean = total / count.clamp(min=1.0)
    # One valid entry has no spread: var 0, whitened value 0.
    var = ((total_sq - total * mean) / (count - 1.0).clamp(min=1.0)).clamp(min=0.0)
    whitened = (x64 - mean) * torch.rsqrt(var + epsilon)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(valid, whitened, 0.0).to(x.dtype)
