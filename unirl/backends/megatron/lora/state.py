"""The adapter in PEFT's names, whole on every rank; a PEFT adapter loaded into the local shards;
and the merged weights (``W + scale * B @ A`` per local shard, computed when read, the model
untouched) for the full-weight export and stream.

Gathering: a column-parallel branch's B rows and a row-parallel branch's A columns are
all-gathered over tensor parallel; a routed expert's adapters over expert parallel (rank r holds
experts ``[r * n, (r + 1) * n)``); each pipeline stage's tensors reach every stage by
``all_gather_object`` over the pipeline group (the adapter is small).

Expert adapters are named per expert, ``model.layers.{i}.mlp.experts.{e}.gate_proj.lora_A``:
the checkpoint names of Qwen3-MoE's experts, which vLLM's LoRA loader maps onto its fused
experts for Qwen3-MoE (it accepts ``experts.{e}.{gate,up,down}_proj`` adapters), and which a
per-expert peft model (transformers' checkpoint layout) loads as they are."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from unirl.backends.megatron.lora.install import Adapted, LoraAdapters, peft_name
from unirl.core.errors import ConfigError
from unirl.core.topology import Topology


def _gather(t: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    size = 1 if group is None else dist.get_world_size(group)
    if size == 1:
        return t
    shards = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(shards, t.contiguous(), group=group)
    return torch.cat(shards, dim=dim)


def _whole(a: Adapted, target: str) -> tuple[torch.Tensor, torch.Tensor]:
    """This branch's A and B of ``target``, gathered over tensor parallel."""
    branch = a.branch
    spec = branch.spec
    A, B = branch.lora_A[target].detach(), branch.lora_B[target].detach()
    if spec.tp_size > 1:
        if spec.kind == "column":
            B = _gather(B, branch.tp_group, 0)
        else:
            A = _gather(A, branch.tp_group, 1)
    if spec.vocab_rows is not None:  # the LM head: megatron's padding rows are no tokens
        B = B[: spec.vocab_rows]
    return A, B


def _stage_state(adapters: LoraAdapters, topology: Topology) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for a in adapters.adapted:
        for target, module in zip(a.branch.spec.adapted, a.branch.spec.hf_modules):
            A, B = _whole(a, target)
            if a.expert is None or topology.ep_size == 1:
                out[peft_name(module, "lora_A")] = A.cpu().clone()
                out[peft_name(module, "lora_B")] = B.cpu().clone()
                continue
            _, expert, per_rank = a.expert
            local = expert - topology.ep_rank * per_rank
            stacked = [_gather(t[None], topology.groups.ep, 0) for t in (A, B)]
            for r in range(topology.ep_size):
                e = r * per_rank + local
                name = module.replace(f".experts.{expert}.", f".experts.{e}.")
                out[peft_name(name, "lora_A")] = stacked[0][r].cpu().clone()
                out[peft_name(name, "lora_B")] = stacked[1][r].cpu().clone()
    return out


def adapter_state_dict(adapters: LoraAdapters, topology: Topology) -> dict[str, torch.Tensor]:
    """The whole adapter, PEFT names, CPU, on every rank (collective), sorted by name."""
    state = _stage_state(adapters, topology)
    if topology.pp_size > 1:
        stages: list[Any] = [None] * topology.pp_size
        dist.all_gather_object(stages, state, group=topology.groups.pp)
        state = {k: v for s in stages for k, v in s.items()}
    return dict(sorted(state.items()))


@torch.no_grad()
def load_adapter(
    adapters: LoraAdapters, tensors: Mapping[str, torch.Tensor], where: str
) -> set[str]:
    """Copy a PEFT adapter's tensors into this rank's shards; returns the names used (the caller
    checks over all ranks that none is left over)."""
    used: set[str] = set()
    for a in adapters.adapted:
        branch = a.branch
        spec = branch.spec
        for target, module in zip(spec.adapted, spec.hf_modules):
            names = [peft_name(module, w) for w in ("lora_A", "lora_B")]
            missing = [n for n in names if n not in tensors]
            if missing:
                raise ConfigError(
                    f"model.lora.path={where!r} has no {missing[0]!r}; the adapter does not "
                    "match model.lora.target_modules / target_experts or the model"
                )
            A, B = (tensors[n] for n in names)
            if spec.vocab_rows is not None and B.shape[0] == spec.vocab_rows:
                padded = spec.layout.widths[0] * spec.tp_size  # megatron's padded vocabulary
                B = torch.cat([B, B.new_zeros(padded - B.shape[0], *B.shape[1:])])
            if spec.tp_size > 1 and spec.kind == "column":
                B = B.chunk(spec.tp_size, dim=0)[spec.tp_rank]
            elif spec.tp_size > 1:
                A = A.chunk(spec.tp_size, dim=1)[spec.tp_rank]
            for name, src, dst in zip(
                names, (A, B), (branch.lora_A[target], branch.lora_B[target])
            ):
                if tuple(src.shape) != tuple(dst.shape):
                    raise ConfigError(
                        f"model.lora.path={where!r}: {name} has shape {tuple(tensors[name].shape)}"
                        f", which does not fit this model's {module} at rank "
                        f"{branch.rank}; the adapter was trained for another model"
                    )
                dst.copy_(src)
            used.update(names)
    return used


class MergedParameters(Mapping[str, torch.Tensor]):
    """A chunk's parameters by name, each adapted linear's weight read as
    ``W + scale * B @ A`` of its local shard (made when read, in W's dtype; W untouched)."""

    def __init__(self, chunk: torch.nn.Module, adapters: LoraAdapters, index: int) -> None:
        self._params = dict(chunk.named_parameters())
        self._branches = {a.weight_name: a.branch for a in adapters.adapted if a.chunk == index}

    def __getitem__(self, name: str) -> torch.Tensor:
        weight = self._params[name]
        branch = self._branches.get(name)
        if branch is None:
            return weight
        delta = branch.local_delta()
        return (weight.detach().float() + delta.to(weight.device)).to(weight.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


def load_peft_folder(adapters: LoraAdapters, path: str) -> None:
    """``model.lora.path``: the PEFT adapter there into this rank's shards (collective: a tensor
    no rank's model takes is refused, naming it, before any training)."""
    from unirl.backends.peft_folder import read_peft_folder

    tensors = read_peft_folder(path, adapters.lora)
    used = load_adapter(adapters, tensors, path)
    if dist.is_initialized():
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, used)
        used = set().union(*everyone)
    unused = sorted(set(tensors) - used)
    if unused:
        raise ConfigError(
            f"model.lora.path={path!r} has {len(unused)} tensor(s) no adapted linear takes, "
            f"first {unused[0]!r}; check model.lora.target_modules / target_experts against "
            "the adapter's"
        )
