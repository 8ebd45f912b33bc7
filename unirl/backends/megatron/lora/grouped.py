"""LoRA on unirl's `GroupedExperts` (all local experts in grouped matmuls): each expert's
adapters (the `LoraBranch` beside its ``linear_fc1`` / ``linear_fc2``, as on megatron's
`SequentialMLP`) run with the experts' own grouping, rows sorted by expert::

    h = x A_e^T            one grouped matmul, every adapted target's A of expert e side by side
    y_t = scale * h_t B_t,e^T   one grouped matmul per adapted target

and ``y`` is added to the base's grouped output in its fused layout (``[gate; up]`` for fc1).
Gradients reach each expert's own A and B (`grouped_linear`). Expert tensor parallel is 1 (the
install refuses more), so no comm."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from unirl.backends.megatron.lora.branch import LoraBranch
from unirl.backends.megatron.moe.grouped_experts import GroupedExperts, grouped_linear


def _branches(experts: GroupedExperts, linear: str) -> list[LoraBranch] | None:
    name = f"{linear}_lora"
    if name not in experts.local_experts[0]._modules:
        return None
    return [e._modules[name] for e in experts.local_experts]


def grouped_branch(
    branches: list[LoraBranch], x_ti: torch.Tensor, offs_e: torch.Tensor
) -> torch.Tensor:
    """Every local expert's branch on its rows, in the base's fused layout."""
    first = branches[0]
    spec, rank = first.spec, first.rank
    if first.dropout:
        x_ti = F.dropout(x_ti, first.dropout, first.training)
    targets = spec.adapted
    a = [
        torch.cat([b.lora_A[t] for t in targets]) if len(targets) > 1 else b.lora_A[targets[0]]
        for b in branches
    ]
    h = grouped_linear(x_ti, offs_e, a) * first.scale
    parts = dict(zip(targets, h.split(rank, dim=-1)))
    outs = [
        grouped_linear(parts[t].contiguous(), offs_e, [b.lora_B[t] for b in branches])
        if t in parts
        else None
        for t in spec.layout.targets
    ]
    return spec.layout.fuse(outs)


class LoraGroupedExperts(GroupedExperts):
    """`GroupedExperts` with its experts' LoRA branches (installed by `install_lora`, which
    gives the module this class); a branch switched off (the reference) adds nothing."""

    def _fc1(self, x_th: torch.Tensor, offs_e: torch.Tensor) -> torch.Tensor:
        return self._with_branch("linear_fc1", super()._fc1(x_th, offs_e), x_th, offs_e)

    def _fc2(self, a_tf: torch.Tensor, offs_e: torch.Tensor) -> torch.Tensor:
        return self._with_branch("linear_fc2", super()._fc2(a_tf, offs_e), a_tf, offs_e)

    def _with_branch(
        self, linear: str, base: torch.Tensor, x: torch.Tensor, offs_e: torch.Tensor
    ) -> torch.Tensor:
        branches = _branches(self, linear)
        if branches is None or not branches[0].enabled:
            return base
        return base + grouped_branch(branches, x, offs_e)
