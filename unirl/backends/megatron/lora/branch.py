"""`LoraBranch`: the low-rank branch beside one megatron-core parallel linear, on the activation
path: ``y = base(x) + scale * B(A(dropout(x)))`` (Hu et al. 2021). The base weight is frozen and
never merged, so the backward costs two rank-r matmuls per target, not the base weight's
gradient.

The tensor-parallel arithmetic follows the base layer's split (the comm is megatron's own
autograd-aware mappings):

- column-parallel (``linear_qkv``, ``linear_fc1``): A ``[r, in]`` whole on every rank, B's rows
  split like the layer's output. ``h = x A^T``; without sequence parallel
  ``copy_to_tensor_model_parallel_region(h)`` (identity forward, all-reduce of dh backward: every
  rank's B shard contributes to A's gradient); with it x holds this rank's tokens, so
  ``gather_from_sequence_parallel_region(h)`` (all-gather forward, reduce-scatter backward) and
  A's gradient is this rank's tokens' share: A is marked ``sequence_parallel`` so megatron's
  ``finalize_model_grads`` sums it over TP (as it does for the norms). Then
  ``y_local = scale * h B_local^T``, placed into the fused layout per target (`FusedLayout`).
- row-parallel (``linear_proj``, ``linear_fc2``): A's columns split like the layer's input, B
  ``[out, r]`` whole. ``h = sum over TP of x_local A_local^T``
  (``reduce_from_tensor_model_parallel_region``); with sequence parallel
  ``reduce_scatter_to_sequence_parallel_region`` (this rank's tokens) and B is marked
  ``sequence_parallel``. ``y = scale * h B^T``.
- a routed expert's linears (``explicit_expert_comm``: the dispatcher moves the tokens and sums
  the partial outputs): no comm; supported with expert tensor parallel 1 (`install` refuses
  more).

The parameters carry megatron's ``tensor_model_parallel`` / ``partition_dim`` (split ones: the
gradient norm counts each shard; an expert's: counted on every rank, as megatron's expert weights
are) and, for experts, ``allreduce = False`` (megatron's expert buffers and expert-parallel
norm)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import attrs
import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from unirl.backends.megatron.lora.layout import FusedLayout

Kind = Literal["column", "row"]
Comm = Literal["tp", "sp", "none"]


@attrs.frozen(kw_only=True)
class BranchSpec:
    """What one branch adapts: the base linear's split and its HF targets.

    ``in_features``: the full input width (a row-parallel layer's is ``in_local * tp``);
    ``layout``: the targets in the base's fused order and each one's local output width;
    ``adapted``: which of them have an adapter; ``hf_modules``: each adapted target's HF module
    path (``model.layers.3.self_attn.q_proj``; a routed expert's on this rank)."""

    kind: Kind
    comm: Comm
    in_features: int
    layout: FusedLayout
    adapted: tuple[str, ...]
    hf_modules: tuple[str, ...]
    tp_size: int
    tp_rank: int
    expert: bool = False
    # The LM head's: the real vocabulary, B's rows in PEFT's adapter (megatron pads its rows to
    # a multiple of 128 x tp; the padding rows stay zero and are cut when exported).
    vocab_rows: int | None = None


class LoraBranch(torch.nn.Module):
    """See the module docstring. ``enabled`` False: the base layer alone (the reference)."""

    def __init__(
        self,
        spec: BranchSpec,
        *,
        rank: int,
        scale: float,
        dropout: float,
        tp_group: Any,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.spec, self.rank, self.scale, self.dropout = spec, rank, scale, dropout
        self.tp_group = tp_group
        self.enabled = True
        self.lora_A = torch.nn.ParameterDict()
        self.lora_B = torch.nn.ParameterDict()
        column = spec.kind == "column"
        in_local = spec.in_features if column else spec.in_features // spec.tp_size
        for target, width in zip(spec.layout.targets, spec.layout.widths):
            if target not in spec.adapted:
                continue
            a = torch.zeros(rank, in_local, dtype=dtype, device=device)
            b = torch.zeros(width, rank, dtype=dtype, device=device)
            self.lora_A[target] = torch.nn.Parameter(a)
            self.lora_B[target] = torch.nn.Parameter(b)
        self._mark()

    def _mark(self) -> None:
        spec = self.spec
        split = spec.tp_size > 1 and spec.comm != "none"
        for target in spec.adapted:
            a, b = self.lora_A[target], self.lora_B[target]
            if split:  # the shard that differs per rank
                sharded, dim = (b, 0) if spec.kind == "column" else (a, 1)
                set_tensor_model_parallel_attributes(sharded, is_parallel=True, dim=dim, stride=1)
            if spec.comm == "sp":  # whole on every rank, gradient from this rank's tokens only
                (a if spec.kind == "column" else b).sequence_parallel = True
            if spec.expert:
                a.allreduce = b.allreduce = False
                # never a tensor-parallel duplicate (megatron's expert optimizer asks the dense
                # TP group): with EP folded into the TP ranks, TP rank 1 holds other experts,
                # whose norm was left out (1.70 for 1.83 on the LoRA contract's moe-tp2-ep2-sp).
                # megatron's expert weights carry the same mark.
                for t in (a, b):
                    set_tensor_model_parallel_attributes(t, is_parallel=True, dim=0, stride=1)

    def forward(self, x: torch.Tensor, base: torch.Tensor | None = None) -> torch.Tensor:
        """The branch's output; added to ``base`` (the linear's output) inside the up
        projection's matmul when given: one pass over the output, where a matmul per target,
        the fusing copy and the add made four (`fused_b`)."""
        if self.dropout:
            x = F.dropout(x, self.dropout, self.training)
        spec = self.spec
        targets = list(spec.adapted)
        if spec.kind == "row":
            h = self._row_comm(F.linear(x, self.lora_A[targets[0]])) * self.scale
            return _up(h, self.lora_B[targets[0]], base)
        a = torch.cat([self.lora_A[t] for t in targets]) if len(targets) > 1 else None
        h = F.linear(x, a if a is not None else self.lora_A[targets[0]])
        h = self._column_comm(h) * self.scale
        return _up(h, self.fused_b(), base)

    def fused_b(self) -> torch.Tensor:
        """Every target's B as one ``[fused width, rank x adapted targets]`` matrix: target t's
        rows in its fused place, its columns the t-th rank block of ``h`` (A's order), zeros
        elsewhere; a linear with one target and no others is its B."""
        spec = self.spec
        if spec.layout.targets == spec.adapted and len(spec.adapted) == 1:
            return self.lora_B[spec.adapted[0]]
        k = self.rank * len(spec.adapted)
        blocks: list[torch.Tensor | None] = []
        for t in spec.layout.targets:
            if t not in spec.adapted:
                blocks.append(None)
                continue
            i = spec.adapted.index(t)
            blocks.append(F.pad(self.lora_B[t], (i * self.rank, k - (i + 1) * self.rank)))
        return spec.layout.fuse_rows(blocks)

    def _column_comm(self, h: torch.Tensor) -> torch.Tensor:
        if self.spec.comm == "sp":
            return gather_from_sequence_parallel_region(
                h, tensor_parallel_output_grad=True, group=self.tp_group
            )
        if self.spec.comm == "tp":
            return copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        return h

    def _row_comm(self, h: torch.Tensor) -> torch.Tensor:
        if self.spec.comm == "sp":
            return reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
        if self.spec.comm == "tp":
            return reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        return h

    @torch.no_grad()
    def local_delta(self) -> torch.Tensor:
        """``scale * B @ A`` of this rank's shard of the base weight, in fp32, fused like it."""
        spec = self.spec

        def delta(t: str) -> torch.Tensor:
            return self.scale * (self.lora_B[t].float() @ self.lora_A[t].float())

        if spec.kind == "row":
            return delta(spec.adapted[0])
        rows: Sequence[torch.Tensor | None] = [
            delta(t) if t in spec.adapted else None for t in spec.layout.targets
        ]
        return spec.layout.fuse_rows(rows)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        """megatron's distributed checkpoint entries: the split shards by their global offsets,
        the whole tensors as replicas (as the base linear's own)."""
        spec = self.spec
        state = self.state_dict(prefix="", keep_vars=True)
        axis: dict[str, int] = {}
        if spec.tp_size > 1 and spec.comm != "none":
            which, dim = ("lora_B", 0) if spec.kind == "column" else ("lora_A", 1)
            axis = {f"{which}.{t}": dim for t in spec.adapted}
        return make_sharded_tensors_for_checkpoint(
            state,
            prefix,
            axis,
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=(metadata or {}).get("dp_cp_group"),
        )


def _up(h: torch.Tensor, b: torch.Tensor, base: torch.Tensor | None) -> torch.Tensor:
    """``base + h b^T`` in one matmul (``h b^T`` without ``base``)."""
    if base is None:
        return F.linear(h, b)
    lead, width = base.shape[:-1], base.shape[-1]
    flat = torch.addmm(base.reshape(-1, width), h.reshape(-1, h.shape[-1]), b.t())
    return flat.view(*lead, width)
