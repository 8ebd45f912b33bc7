"""Put `LoraBranch` adapters on a model's chunks for ``model.lora`` and freeze the base.

Each adapted megatron linear gets a sibling module ``<linear>_lora`` (``linear_qkv_lora`` beside
``linear_qkv``; so the base's parameter names, the Hugging Face conversion and the base's
checkpoint entries are unchanged) and a forward hook adding the branch to the linear's output.
Targets are HF module names (`layout.HF_MODULE`); routed experts (``model.lora.target_experts``)
get an adapter per expert, living with its expert under expert parallel: on megatron's
`SequentialMLP` through the same hook, on unirl's `GroupedExperts` run grouped
(`grouped.LoraGroupedExperts`). Pipeline and virtual-pipeline stages adapt the layers they hold;
context parallel changes nothing here (each rank's tokens go through the same linears, and the adapter's
gradient is reduced over data x context parallel by megatron's DDP like every other one).

A's initialisation: for each HF module, ``A ~ U(-1/sqrt(in), 1/sqrt(in))`` (peft's
``kaiming_uniform_(a=sqrt(5))`` bound) drawn on the full ``[rank, in]`` tensor from a generator
seeded with ``model.lora.init_seed + crc32(<PEFT name of A>)``, so every layout draws the same
adapter; B starts at zero (the first policy is the base model)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer

from unirl.backends.megatron.lora.branch import BranchSpec, Comm, LoraBranch
from unirl.backends.megatron.lora.grouped import LoraGroupedExperts
from unirl.backends.megatron.lora.layout import (
    ADAPTABLE,
    ATTENTION_TARGETS,
    HEAD,
    HF_MODULE,
    MLP_TARGETS,
    SUFFIX,
    FusedLayout,
)
from unirl.backends.megatron.moe.grouped_experts import GroupedExperts
from unirl.backends.peft_folder import initial_lora_a
from unirl.core.config.sections.lora import LoraConfig
from unirl.core.errors import ConfigError


def peft_name(hf_module: str, which: str) -> str:
    """PEFT's state-dict name of a module's ``lora_A`` / ``lora_B``."""
    return f"base_model.model.{hf_module}.{which}.weight"


def check_targets(lora: LoraConfig) -> None:
    """Refuse a target this backend has no linear for (before anything is built)."""
    bad = [t for t in lora.target_modules if t not in ADAPTABLE]
    if bad:
        raise ConfigError(
            f"model.lora.target_modules: {bad} cannot be adapted by the Megatron backend; it "
            f"adapts the decoder layers' linears and the LM head {list(ADAPTABLE)} (not the "
            "embeddings): remove them or use backend: deepspeed / fsdp2"
        )


@attrs.frozen
class Adapted:
    """One installed branch: its chunk, its name prefix there and the base linear's weight."""

    chunk: int
    name: str  # "decoder.layers.0.self_attention.linear_qkv_lora"
    weight_name: str  # "decoder.layers.0.self_attention.linear_qkv.weight"
    branch: LoraBranch
    expert: tuple[int, int, int] | None  # (HF layer, global expert, experts per EP rank)


class LoraAdapters:
    """The branches installed on one model's chunks (see the module docstring)."""

    def __init__(self, lora: LoraConfig, adapted: list[Adapted]) -> None:
        self.lora = lora
        self.adapted = adapted

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        for a in self.adapted:
            yield from a.branch.parameters()

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Every branch off: the base model (the reference under LoRA)."""
        for a in self.adapted:
            a.branch.enabled = False
        try:
            yield
        finally:
            for a in self.adapted:
                a.branch.enabled = True


def _add_branch(branch: LoraBranch, module: Any, args: tuple, output: Any) -> Any:
    if not branch.enabled:
        return output
    out, bias = output
    return branch(args[0], out), bias


def _comm(linear: Any, where: str) -> Comm:
    if linear.explicit_expert_comm:
        if linear.tp_group.size() > 1:
            raise ConfigError(
                f"model.lora.target_experts with parallel.etp={linear.tp_group.size()} ({where}): "
                "expert adapters need expert tensor parallel 1; set parallel.etp: 1"
            )
        return "none"
    return "sp" if linear.sequence_parallel else "tp"


def _layout(owner: Any, linear_name: str, linear: Any, targets: tuple[str, ...]) -> FusedLayout:
    out = linear.weight.shape[0]
    if linear_name == "linear_qkv":
        d = owner.hidden_size_per_attention_head
        groups = owner.num_query_groups_per_partition
        q = owner.num_attention_heads_per_partition * d
        return FusedLayout(targets, (q, groups * d, groups * d), groups)
    if linear_name == "linear_fc1":
        return FusedLayout(targets, (out // 2, out // 2))
    return FusedLayout(targets, (out,))


def _init_a(branch: LoraBranch, lora: LoraConfig) -> None:
    spec = branch.spec
    for target, module in zip(spec.adapted, spec.hf_modules):
        name = peft_name(module, "lora_A")
        full = initial_lora_a(name, lora.rank, spec.in_features, lora.init_seed)
        if spec.kind == "row":
            full = full.chunk(spec.tp_size, dim=1)[spec.tp_rank]
        with torch.no_grad():
            branch.lora_A[target].copy_(full)


def _install(
    owner: torch.nn.Module,
    linear_name: str,
    targets: tuple[str, ...],
    hf_prefix: str,
    lora: LoraConfig,
    *,
    expert: bool,
    vocab_rows: int | None = None,
) -> LoraBranch | None:
    adapted = tuple(t for t in targets if t in lora.target_modules)
    if not adapted:
        return None
    linear = getattr(owner, linear_name)
    where = f"{hf_prefix}{HF_MODULE.get(adapted[0], adapted[0]).split('.')[-1]}"
    if type(linear) not in (ColumnParallelLinear, RowParallelLinear):
        raise ConfigError(
            f"model.lora.target_modules: {list(adapted)} at {where} is a "
            f"{type(linear).__name__}; the Megatron backend adapts megatron-core's "
            "ColumnParallelLinear / RowParallelLinear only (not Transformer Engine's layers): "
            "remove the target or run without Transformer Engine"
        )
    column = isinstance(linear, ColumnParallelLinear)
    tp = linear.tp_group.size()
    in_features = linear.weight.shape[1] * (1 if column or linear.explicit_expert_comm else tp)
    comm = _comm(linear, where)
    if lora.dropout and comm != "none" and tp > 1:
        raise ConfigError(
            f"model.lora.dropout={lora.dropout} with tensor parallel {tp}: the Megatron "
            "backend's adapters have no tensor-parallel dropout RNG; set model.lora.dropout: 0"
        )
    spec = BranchSpec(
        kind="column" if column else "row",
        comm=comm,
        in_features=in_features,
        layout=_layout(owner, linear_name, linear, targets),
        adapted=adapted,
        hf_modules=tuple(hf_prefix + HF_MODULE.get(t, t).split(".")[-1] for t in adapted),
        tp_size=tp if comm != "none" else 1,
        tp_rank=linear.tp_group.rank() if comm != "none" else 0,
        expert=expert,
        vocab_rows=vocab_rows,
    )
    branch = LoraBranch(
        spec,
        rank=lora.rank,
        scale=lora.scale,
        dropout=lora.dropout,
        tp_group=linear.tp_group,
        dtype=linear.weight.dtype,
        device=linear.weight.device,
    )
    _init_a(branch, lora)
    owner.add_module(linear_name + SUFFIX, branch)
    linear.register_forward_hook(lambda m, a, o: _add_branch(branch, m, a, o))
    return branch


def _check_grouped_rank(experts: GroupedExperts, lora: LoraConfig) -> None:
    """``torch._grouped_mm`` reads rows in 16-byte steps (on every device): the adapter's
    ``[T, rank]`` rows too."""
    weight = experts.local_experts[0].linear_fc1.weight
    per_row = 16 // weight.element_size()
    if lora.rank % per_row:
        raise ConfigError(
            f"model.lora.rank={lora.rank} with target_experts on grouped experts "
            f"({weight.dtype}): torch's grouped matmul needs a rank that is a multiple of "
            f"{per_row}; choose one, or set megatron.experts: sequential"
        )


def _layer_owners(layer: Any, layer_index: int, lora: LoraConfig) -> Iterator[tuple]:
    """(module, linear name, its targets, HF module prefix, expert) for one decoder layer."""
    attn = f"model.layers.{layer_index}.self_attn."
    for name, targets in ATTENTION_TARGETS.items():
        yield layer.self_attention, name, targets, attn, None
    mlp = layer.mlp
    if isinstance(mlp, MLP):
        for name, targets in MLP_TARGETS.items():
            yield mlp, name, targets, f"model.layers.{layer_index}.mlp.", None
        return
    assert isinstance(mlp, MoELayer), type(mlp)
    if not lora.target_experts:
        return
    experts = mlp.experts
    if type(experts) not in (SequentialMLP, GroupedExperts, LoraGroupedExperts):
        raise ConfigError(
            f"model.lora.target_experts on layer {layer_index}: its experts are "
            f"{type(experts).__name__}; expert adapters run on megatron's SequentialMLP or "
            "unirl's grouped experts: set megatron.experts: grouped or sequential, or "
            "model.lora.target_experts: false"
        )
    if isinstance(experts, GroupedExperts):
        _check_grouped_rank(experts, lora)
        experts.__class__ = LoraGroupedExperts  # its forward adds the experts' branches
    for local, expert_mlp in enumerate(experts.local_experts):
        e = mlp.local_expert_indices[local]
        info = (layer_index, e, mlp.num_local_experts)
        for name, targets in MLP_TARGETS.items():
            yield expert_mlp, name, targets, f"model.layers.{layer_index}.mlp.experts.{e}.", info


def _embedding_output_requires_grad(module: Any, args: tuple, output: torch.Tensor) -> Any:
    return output.requires_grad_() if not output.requires_grad else output


def _install_head(chunk: torch.nn.Module, lora: LoraConfig, vocab_size: int) -> LoraBranch | None:
    """The LM head's adapter on the last stage's ``output_layer`` (untied: a tied head is the
    embedding's weight, which has no linear of its own to hook)."""
    if HEAD not in lora.target_modules or not chunk.post_process:
        return None
    if chunk.share_embeddings_and_output_weights:
        raise ConfigError(
            "model.lora.target_modules: lm_head on a model with tied embeddings "
            "(tie_word_embeddings): the Megatron backend adapts an untied LM head only; "
            "remove lm_head from the targets"
        )
    return _install(chunk, "output_layer", (HEAD,), "", lora, expert=False, vocab_rows=vocab_size)


def install_lora(
    chunks: Sequence[torch.nn.Module],
    lora: LoraConfig,
    *,
    vocab_size: int,
    recompute: bool = False,
) -> LoraAdapters:
    """Adapters on every targeted linear of ``chunks``; every other parameter frozen.

    ``recompute`` (megatron's full activation recompute): its checkpoint function is an
    autograd function whose outputs need grad only if an input does, and the frozen
    embedding's output does not, so the first stage's recomputed layers would give their
    adapters no gradient; the embedding's output is marked as needing one (the same fix as
    transformers' ``enable_input_require_grads``). ``vocab_size``: the model's real vocabulary
    (the LM head's adapter exports that many of megatron's padded rows)."""
    check_targets(lora)
    for chunk in chunks:
        chunk.requires_grad_(False)
        if recompute and chunk.pre_process:
            chunk.embedding.register_forward_hook(_embedding_output_requires_grad)
    adapted: list[Adapted] = []
    for c, chunk in enumerate(chunks):
        names = {id(m): n for n, m in chunk.named_modules()}
        for layer in chunk.decoder.layers:
            for owner, name, targets, prefix, expert in _layer_owners(
                layer, layer.layer_number - 1, lora
            ):
                branch = _install(owner, name, targets, prefix, lora, expert=expert is not None)
                if branch is not None:
                    base = f"{names[id(owner)]}.{name}"
                    adapted.append(Adapted(c, base + SUFFIX, base + ".weight", branch, expert))
        head = _install_head(chunk, lora, vocab_size)
        if head is not None:
            adapted.append(Adapted(c, "output_layer" + SUFFIX, "output_layer.weight", head, None))
    if not adapted:
        raise ConfigError(
            f"model.lora.target_modules={list(lora.target_modules)} adapt no linear of this "
            "pipeline stage's layers; name linears the model has"
        )
    return LoraAdapters(lora, adapted)
