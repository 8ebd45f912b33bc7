"""Loss metrics tagged with their denominator, reduced exactly across microbatches and ranks.

A mean over a step is not the mean of per-microbatch means (microbatches hold different numbers
of tokens), so every metric carries a numerator and the count it should be divided by. Reducing
sums both over all microbatches and all DP x CP ranks and divides once at the end
(NeMo-RL's convention). The tensors stay on the device until `reduce_metrics`, which does one
all-reduce and one host sync for the whole step, not one per microbatch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs
import torch
import torch.distributed as dist

from unirl.core.errors import LossInputError

MetricKind = Literal["tokens", "sequences", "decisions", "max"]


@attrs.frozen(kw_only=True, eq=False)
class Metric:
    """``numerator / denominator`` after both are summed over microbatches and ranks.

    ``kind`` names what the denominator counts: valid tokens, or sequences (a sequence counted
    as the sum of ``1 / n_s`` over its valid tokens, so it adds up to one across CP ranks).
    Kind ``decisions`` counts MoE routing decisions (one token at one MoE layer,
    `unirl.core.maths.losses.router_disagreement`).
    Kind ``max`` is a maximum instead: ``numerator`` is this microbatch's largest value (-inf
    with no valid token), reduced by max; the denominator is unused.
    """

    numerator: torch.Tensor
    denominator: torch.Tensor | float
    kind: MetricKind


def reduce_metrics(metrics: Sequence[Mapping[str, Metric]], group: Any = None) -> dict[str, float]:
    """Reduce the metric dicts of every microbatch of this rank, and of every rank of ``group``.

    ``group`` is the data-parallel-with-context-parallel process group (``Topology.groups.dp_cp``);
    ``None`` means this process is the only one (no communication). Every rank of the group must
    call this with the same metric names (they depend only on the settings and on which inputs
    exist, which are the same on every rank). A metric whose summed denominator is 0 (e.g. a step
    with no valid token) reports 0.0.
    """
    kinds: dict[str, MetricKind] = {}
    for per_mb in metrics:
        for name, m in per_mb.items():
            if kinds.setdefault(name, m.kind) != m.kind:
                raise LossInputError(
                    f"metric {name!r} is counted in {kinds[name]} in one microbatch and in "
                    f"{m.kind} in another; a metric must keep one denominator kind"
                )
    names = sorted(k for k, kind in kinds.items() if kind != "max")
    max_names = sorted(k for k, kind in kinds.items() if kind == "max")
    if not kinds:
        return {}
    device = next(m.numerator.device for per_mb in metrics for m in per_mb.values())
    result = _reduce_max(metrics, max_names, device, group) if max_names else {}
    if not names:
        return result
    zero = torch.zeros((), dtype=torch.float64, device=device)
    nums = [zero.clone() for _ in names]
    dens = [zero.clone() for _ in names]
    for per_mb in metrics:
        for i, name in enumerate(names):
            m = per_mb.get(name)
            if m is None:
                continue
            nums[i] = nums[i] + m.numerator.detach().to(device, torch.float64)
            dens[i] = dens[i] + torch.as_tensor(m.denominator, device=device).to(torch.float64)
    stacked = torch.stack(nums + dens)
    if group is not None:
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=group)
    values = stacked.tolist()  # the one host sync of the step
    n = len(names)
    return result | {
        name: (values[i] / values[n + i] if values[n + i] != 0 else 0.0)
        for i, name in enumerate(names)
    }


def _reduce_max(
    metrics: Sequence[Mapping[str, Metric]], names: list[str], device: Any, group: Any
) -> dict[str, float]:
    """The ``max`` metrics: max over microbatches, then one MAX all-reduce over ``group``."""
    values = torch.full((len(names),), float("-inf"), dtype=torch.float64, device=device)
    for per_mb in metrics:
        for i, name in enumerate(names):
            m = per_mb.get(name)
            if m is not None:
                values[i] = torch.maximum(values[i], m.numerator.detach().to(device, torch.float64))
    if group is not None:
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return {name: (v if v != float("-inf") else 0.0) for name, v in zip(names, values.tolist())}
