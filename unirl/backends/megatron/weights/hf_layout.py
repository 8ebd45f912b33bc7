"""Hugging Face Llama / Qwen2 / Qwen3 / Qwen3-MoE weights <-> megatron-core GPTModel chunks, in any
TP / PP / VPP / EP layout.

Written here rather than taken from a library: megatron-bridge (0.3.1, the newest release pip
resolves for megatron-core 0.16 / Python 3.11) requires transformer-engine, transformers < 5,
mamba-ssm and more; mbridge 0.15 hard-codes the TE layer spec and moves models to CUDA. Neither
builds or converts a model on a CPU-only machine with transformers 5.

Megatron's layouts, per decoder layer (HF names on the right):

- ``linear_qkv`` [groups * (heads/groups + 2) * D, H]: for each key/value group in turn, the
  group's query heads, then its key head, then its value head (``q_proj`` / ``k_proj`` /
  ``v_proj``; the same for Qwen2's biases). TP rank r holds groups [r*G/tp, (r+1)*G/tp): a
  contiguous block of the interleaved rows.
- ``linear_fc1`` [2 * F / tp, H] on rank r: ``[gate_r; up_r]`` (``gate_proj``, ``up_proj``
  each split into tp row blocks).
- ``linear_proj`` / ``linear_fc2``: row parallel, split along the input dimension.
- Qwen3's ``q_layernorm`` / ``k_layernorm`` (``q_norm`` / ``k_norm``, over one head): whole on
  every rank.
- Qwen3-MoE: ``mlp.router`` (``mlp.gate``) whole on every rank; expert ``e`` lives on
  expert-parallel rank ``e // (E / ep)`` as ``mlp.experts.local_experts.{e % (E / ep)}``, its
  ``linear_fc1`` / ``linear_fc2`` split over the expert tensor-parallel ranks (``etp``) exactly as
  a dense MLP over ``tp`` (HF: ``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``, the
  checkpoint names; transformers 5's in-memory fused ``mlp.experts.gate_up_proj [E, 2F, H]`` /
  ``down_proj [E, H, F]`` are read too, see `PerExpertView`).
- ``word_embeddings`` / ``output_layer``: the vocabulary padded with zero rows to a multiple of
  ``divisible_by * tp``, split into tp row blocks.
- layer ``layer_number`` (1-based, set by megatron per stage / virtual stage) is HF layer
  ``layer_number - 1``.

Export gathers TP shards with all-gather, experts over the expert-parallel group with all-gather
and pipeline stages with broadcasts, so every rank ends with the full HF state dict (the weight
sync to a rollout engine needs it on every rank); `save_hf` writes it from rank 0. Loading
refuses a source with a tensor no parameter takes (a weight the conversion would drop), and
export refuses to return a state dict missing or adding a name.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist

from unirl.backends.megatron.lora.layout import is_adapter_parameter
from unirl.core.errors import ConfigError
from unirl.core.topology import Topology

# A chunk's parameters by name as an export reads them: its own (`own_parameters`), or under
# LoRA the adapted weights merged (`unirl.backends.megatron.lora.state.MergedParameters`).
ParamsOf = Callable[[int, torch.nn.Module], Mapping[str, torch.Tensor]]


def own_parameters(index: int, chunk: torch.nn.Module) -> Mapping[str, torch.Tensor]:
    """Chunk ``index``'s parameters as they are."""
    return dict(chunk.named_parameters())


# --- pure tensor layout functions ----------------------------------------------------------


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's padded vocabulary: the next multiple of ``divisible_by * tp`` (each TP shard
    then has a multiple of ``divisible_by`` rows)."""
    if vocab_size < 1 or tp < 1 or divisible_by < 1:
        raise ConfigError(
            f"padded_vocab_size: vocab_size={vocab_size}, tp={tp}, divisible_by={divisible_by} "
            "must all be >= 1"
        )
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def attention_dims(hf_config: Any) -> dict[str, int]:
    """``num_heads``, ``num_query_groups`` (key/value heads) and ``head_dim`` of an HF config."""
    heads = hf_config.num_attention_heads
    return {
        "num_heads": heads,
        "num_query_groups": getattr(hf_config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
    }


def interleave_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, num_query_groups: int
) -> torch.Tensor:
    """HF ``q [heads*D, ...]``, ``k`` / ``v [groups*D, ...]`` -> Megatron's fused rows
    ``[g0: q heads of g0, k0, v0, g1: ...]`` (weights 2-D, biases 1-D)."""
    rest = q.shape[1:]
    qg = q.reshape(num_query_groups, -1, *rest)
    kg = k.reshape(num_query_groups, -1, *rest)
    vg = v.reshape(num_query_groups, -1, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def deinterleave_qkv(
    qkv: torch.Tensor, *, num_heads: int, num_query_groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `interleave_qkv` on the full (TP-gathered) fused tensor."""
    rest = qkv.shape[1:]
    per_group = num_heads // num_query_groups * head_dim
    grouped = qkv.reshape(num_query_groups, per_group + 2 * head_dim, *rest)
    q, k, v = grouped.split([per_group, head_dim, head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def shard_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    num_query_groups: int,
    tp_size: int,
    tp_rank: int,
) -> torch.Tensor:
    """TP rank ``tp_rank``'s rows of the fused qkv: its whole query groups."""
    return interleave_qkv(q, k, v, num_query_groups=num_query_groups).chunk(tp_size)[tp_rank]


def fuse_gate_up(
    gate: torch.Tensor, up: torch.Tensor, *, tp_size: int, tp_rank: int
) -> torch.Tensor:
    """TP rank ``tp_rank``'s ``linear_fc1``: ``[gate block r; up block r]``."""
    return torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]])


def unfuse_gate_up(shards: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The HF ``gate_proj`` and ``up_proj`` from every TP rank's ``linear_fc1`` (rank order)."""
    halves = [s.chunk(2) for s in shards]
    return torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])


def pad_vocab(weight: torch.Tensor, padded: int) -> torch.Tensor:
    """Append zero rows up to ``padded`` (their logits are 0 and masked out of the softmax)."""
    extra = padded - weight.shape[0]
    assert extra >= 0, (weight.shape, padded)
    return torch.cat([weight, weight.new_zeros(extra, *weight.shape[1:])]) if extra else weight


# --- the name map --------------------------------------------------------------------------


@attrs.frozen
class Entry:
    """One Megatron parameter of a chunk and the HF tensors it is made of.

    ``kind``: ``replicated`` (norms), ``vocab`` (padded, rows split), ``row`` (split along dim 1),
    ``qkv`` (fused by query group), ``fc1`` (gate and up fused per TP block). ``expert``: for a
    routed expert's weight, (HF layer, global expert index, experts per expert-parallel rank);
    its ``row`` / ``fc1`` split is over the expert tensor-parallel ranks.
    """

    megatron_name: str
    hf_names: tuple[str, ...]
    kind: str
    expert: tuple[int, int, int] | None = None


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# local (and Transformer Engine) parameter name inside a layer -> (HF names, kind)
_LAYER_PARAMS: dict[str, tuple[tuple[str, ...], str]] = {
    "input_layernorm.weight": (("input_layernorm.weight",), "replicated"),
    "self_attention.linear_qkv.layer_norm_weight": (("input_layernorm.weight",), "replicated"),
    "self_attention.linear_qkv.weight": (
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "qkv",
    ),
    "self_attention.linear_qkv.bias": (
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        "qkv",
    ),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), "row"),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), "replicated"),
    "mlp.linear_fc1.layer_norm_weight": (("post_attention_layernorm.weight",), "replicated"),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "fc1"),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), "row"),
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), "replicated"),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), "replicated"),
    "mlp.router.weight": (("mlp.gate.weight",), "replicated"),
}
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")


def expert_hf_names(layer: int, expert: int, which: str) -> tuple[str, ...]:
    """HF checkpoint names of one expert's ``linear_fc1`` (gate, up) or ``linear_fc2`` (down)."""
    prefix = f"model.layers.{layer}.mlp.experts.{expert}."
    if which == "linear_fc1":
        return (prefix + "gate_proj.weight", prefix + "up_proj.weight")
    return (prefix + "down_proj.weight",)


# A critic's value head (its ``is_value_head``) replaces the output layer: ``Linear(hidden, 1)``
# whole on every TP rank, in HF's token-classification names.
_VALUE_HEAD = {"output_layer.weight": "score.weight", "output_layer.bias": "score.bias"}


def chunk_entries(chunk: torch.nn.Module, hf_config: Any) -> list[Entry]:
    """Every parameter of ``chunk`` mapped to its HF tensors; layer indices are the layers'
    own ``layer_number - 1``, so any PP / VPP split megatron chose is followed."""
    tied = bool(hf_config.tie_word_embeddings)
    value_head = getattr(getattr(chunk, "output_layer", None), "is_value_head", False)
    layer_index = [layer.layer_number - 1 for layer in chunk.decoder.layers]
    entries = []
    for name, _ in chunk.named_parameters():
        if is_adapter_parameter(name):
            continue  # a LoRA adapter's: exported as a PEFT adapter, not as a model weight
        if name == "embedding.word_embeddings.weight":
            entries.append(Entry(name, ("model.embed_tokens.weight",), "vocab"))
        elif (
            value_head and name in _VALUE_HEAD
        ):  # a critic's head (`unirl.backends.megatron.critic`)
            entries.append(Entry(name, (_VALUE_HEAD[name],), "replicated"))
        elif name == "output_layer.weight":
            # tied with pp > 1: the last stage's copy of the embedding
            hf = "model.embed_tokens.weight" if tied else "lm_head.weight"
            entries.append(Entry(name, (hf,), "vocab"))
        elif name == "decoder.final_layernorm.weight":
            entries.append(Entry(name, ("model.norm.weight",), "replicated"))
        elif (m := _LAYER.match(name)) and m.group(2) in _LAYER_PARAMS:
            hf_suffixes, kind = _LAYER_PARAMS[m.group(2)]
            prefix = f"model.layers.{layer_index[int(m.group(1))]}."
            entries.append(Entry(name, tuple(prefix + s for s in hf_suffixes), kind))
        elif (m := _LAYER.match(name)) and (e := _EXPERT.match(m.group(2))):
            moe = chunk.decoder.layers[int(m.group(1))].mlp
            layer, local, which = layer_index[int(m.group(1))], int(e.group(1)), e.group(2)
            expert = moe.local_expert_indices[local]
            kind = "fc1" if which == "linear_fc1" else "row"
            names = expert_hf_names(layer, expert, which)
            entries.append(Entry(name, names, kind, (layer, expert, moe.num_local_experts)))
        else:
            raise NotImplementedError(
                f"no Hugging Face equivalent known for Megatron parameter {name!r}"
            )
    return entries


def is_value_model(hf_config: Any) -> bool:
    """A critic's config (``*ForTokenClassification``, one label) rather than a causal LM's."""
    return any(a.endswith("ForTokenClassification") for a in hf_config.architectures or ())


def expected_hf_names(hf_config: Any) -> list[str]:
    """The HF state-dict keys of a Llama / Qwen2 model (without the tied ``lm_head``), or of its
    one-label token classifier (a critic: ``score`` instead of ``lm_head``)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if is_value_model(hf_config):
        names += ["score.weight", "score.bias"]
    elif not hf_config.tie_word_embeddings:
        names.append("lm_head.weight")
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    per_layer += [f"self_attn.{p}_proj.weight" for p in "qkvo"]
    if hf_config.model_type == "qwen2":
        per_layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if hf_config.model_type in ("qwen3", "qwen3_moe"):
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    dense = [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    sparse = _moe_layers(hf_config)
    for i in range(hf_config.num_hidden_layers):
        names += [f"model.layers.{i}.{s}" for s in per_layer]
        if i in sparse:
            names.append(f"model.layers.{i}.mlp.gate.weight")
            for e in range(hf_config.num_experts):
                names += [
                    *expert_hf_names(i, e, "linear_fc1"),
                    *expert_hf_names(i, e, "linear_fc2"),
                ]
        else:
            names += [f"model.layers.{i}.{s}" for s in dense]
    return names


def _moe_layers(hf_config: Any) -> set[int]:
    if hf_config.model_type != "qwen3_moe":
        return set()
    from unirl.backends.megatron.moe.layers import moe_layer_pattern

    return {i for i, sparse in enumerate(moe_layer_pattern(hf_config)) if sparse}


_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


class PerExpertView(Mapping[str, torch.Tensor]):
    """``weights`` with transformers 5's fused expert tensors (``mlp.experts.gate_up_proj``
    ``[E, 2F, H]``: gate rows then up rows; ``mlp.experts.down_proj`` ``[E, H, F]``, what an
    in-memory ``Qwen3MoeForCausalLM.state_dict()`` holds) answered under the per-expert
    checkpoint names; every other tensor as it is."""

    def __init__(self, weights: Mapping[str, torch.Tensor]) -> None:
        self._weights = weights
        self._split: dict[str, tuple[str, int, int | None]] = {}  # name -> (fused, expert, half)
        for name in weights:
            if m := _FUSED_EXPERTS.match(name):
                prefix, which = m.groups()
                experts = weights[name].shape[0]
                for e in range(experts):
                    if which == "gate_up_proj":
                        self._split[f"{prefix}.{e}.gate_proj.weight"] = (name, e, 0)
                        self._split[f"{prefix}.{e}.up_proj.weight"] = (name, e, 1)
                    else:
                        self._split[f"{prefix}.{e}.down_proj.weight"] = (name, e, None)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._split:
            fused, e, half = self._split[name]
            t = self._weights[fused][e]
            return t if half is None else t.chunk(2)[half]
        if _FUSED_EXPERTS.match(name):
            raise KeyError(name)
        return self._weights[name]

    def __iter__(self) -> Iterator[str]:
        yield from (n for n in self._weights if not _FUSED_EXPERTS.match(n))
        yield from self._split

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, name: object) -> bool:
        return name in self._split or (
            isinstance(name, str) and not _FUSED_EXPERTS.match(name) and name in self._weights
        )


def check_nothing_dropped(weights: Mapping[str, torch.Tensor], hf_config: Any, where: str) -> None:
    """Refuse a source with a tensor the model has no parameter for (the conversion would drop
    it silently: a shared expert, an expert beyond num_experts, a bias the config says is off)."""
    expected = set(expected_hf_names(hf_config))
    if hf_config.tie_word_embeddings:
        expected.add("lm_head.weight")  # HF's in-memory state dict repeats the tied embedding
    unused = sorted(n for n in weights if n not in expected)
    if unused:
        raise ConfigError(
            f"weights in {where} have {len(unused)} tensor(s) the Megatron model of "
            f"model.hf_config (model_type={hf_config.model_type!r}) has no parameter for, "
            f"first {unused[0]!r}; converting would drop them: check that model.hf_config "
            "matches the weights"
        )


# --- HF -> Megatron ------------------------------------------------------------------------


def _split_ranks(entry: Entry, topology: Topology) -> tuple[int, int]:
    """(size, rank) of the tensor-parallel split of ``entry``: expert TP for a routed expert."""
    if entry.expert is not None:
        return topology.etp_size, topology.etp_rank
    return topology.tp_size, topology.tp_rank


def _local_tensor(
    entry: Entry, hf: list[torch.Tensor], hf_config: Any, tp_size: int, tp_rank: int, padded: int
) -> torch.Tensor:
    if entry.kind == "replicated":
        return hf[0]
    if entry.kind == "vocab":
        return pad_vocab(hf[0], padded).chunk(tp_size)[tp_rank]
    if entry.kind == "row":
        return hf[0].chunk(tp_size, dim=1)[tp_rank]
    if entry.kind == "qkv":
        groups = attention_dims(hf_config)["num_query_groups"]
        return shard_qkv(*hf, num_query_groups=groups, tp_size=tp_size, tp_rank=tp_rank)
    if entry.kind == "fc1":
        return fuse_gate_up(hf[0], hf[1], tp_size=tp_size, tp_rank=tp_rank)
    raise AssertionError(entry.kind)


@torch.no_grad()
def load_hf_weights(
    chunks: Sequence[torch.nn.Module],
    source: Mapping[str, torch.Tensor] | str | Path,
    hf_config: Any,
    topology: Topology,
) -> None:
    """Copy HF weights into this rank's model chunks (every parameter is written).

    ``source``: an HF state dict, or a local folder with safetensors (read lazily: a rank reads
    only the tensors of its own layers).
    """
    from unirl.backends.megatron.weights.hf_io import HFSafetensors

    weights = PerExpertView(HFSafetensors(source) if isinstance(source, (str, Path)) else source)
    where = f"{source}" if isinstance(source, (str, Path)) else "the HF state dict"
    check_nothing_dropped(weights, hf_config, where)
    for chunk in chunks:
        params = dict(chunk.named_parameters())
        padded = chunk.vocab_size  # the padded vocabulary the chunk was built with
        for entry in chunk_entries(chunk, hf_config):
            missing = [n for n in entry.hf_names if n not in weights]
            if missing:
                raise ConfigError(
                    f"weights in {where} have no {missing[0]!r} (needed for Megatron's "
                    f"{entry.megatron_name}); the weights do not match model.hf_config "
                    f"(model_type={hf_config.model_type!r})"
                )
            hf = [weights[n] for n in entry.hf_names]
            split, rank = _split_ranks(entry, topology)
            local = _local_tensor(entry, hf, hf_config, split, rank, padded)
            param = params[entry.megatron_name]
            if local.shape != param.shape:
                raise ConfigError(
                    f"weights in {where}: {entry.hf_names} with shapes "
                    f"{[tuple(t.shape) for t in hf]} give {tuple(local.shape)} for Megatron's "
                    f"{entry.megatron_name}, which is {tuple(param.shape)} at tp={split}; "
                    "the weights do not match model.hf_config"
                )
            param.copy_(local)


# --- Megatron -> HF ------------------------------------------------------------------------


def _all_gather(t: torch.Tensor, size: int, group: Any) -> list[torch.Tensor]:
    if size == 1:
        return [t]
    shards = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(shards, t.contiguous(), group=group)
    return shards


def _tp_gather(t: torch.Tensor, topology: Topology, *, expert: bool = False) -> list[torch.Tensor]:
    if expert:
        return _all_gather(t, topology.etp_size, topology.groups.etp)
    return _all_gather(t, topology.tp_size, topology.groups.tp)


def _expert_parallel_entries(entry: Entry, topology: Topology) -> list[Entry]:
    """The same parameter on each expert-parallel rank, in rank order: the expert it holds there
    (rank r holds experts [r * n, (r + 1) * n))."""
    assert entry.expert is not None
    layer, expert, per_rank = entry.expert
    local = expert - topology.ep_rank * per_rank
    which = "linear_fc1" if entry.kind == "fc1" else "linear_fc2"
    out = []
    for r in range(topology.ep_size):
        e = r * per_rank + local
        out.append(attrs.evolve(entry, hf_names=expert_hf_names(layer, e, which), expert=None))
    return out


def _hf_tensors(
    entry: Entry, shards: list[torch.Tensor], hf_config: Any
) -> Iterator[tuple[str, torch.Tensor]]:
    if entry.kind == "replicated":
        yield entry.hf_names[0], shards[0]
    elif entry.kind == "vocab":
        yield entry.hf_names[0], torch.cat(shards)[: hf_config.vocab_size]
    elif entry.kind == "row":
        yield entry.hf_names[0], torch.cat(shards, dim=1)
    elif entry.kind == "qkv":
        yield from zip(
            entry.hf_names, deinterleave_qkv(torch.cat(shards), **attention_dims(hf_config))
        )
    elif entry.kind == "fc1":
        yield from zip(entry.hf_names, unfuse_gate_up(shards))
    else:
        raise AssertionError(entry.kind)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy with its own storage (safetensors needs both; views of one fused
    qkv must not share storage)."""
    return torch.empty(t.shape, dtype=t.dtype, device="cpu").copy_(t)


def stage_hf_tensors(
    chunks: Sequence[torch.nn.Module],
    hf_config: Any,
    topology: Topology,
    params_of: ParamsOf = own_parameters,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors of this pipeline stage, on the parameters' device, TP- (and EP-) gathered
    one parameter at a time, so the device holds at most one gathered parameter beyond the
    shards; the same on every TP rank (collective over the TP / EP groups: every rank of the
    stage runs it to the end). Tensors may be views of one gathered parameter (a fused qkv)."""
    for index, chunk in enumerate(chunks):
        params = params_of(index, chunk)
        for entry in chunk_entries(chunk, hf_config):
            if entry.megatron_name == "output_layer.weight" and hf_config.tie_word_embeddings:
                continue  # the first stage's embedding is the one copy HF keeps
            param = params[entry.megatron_name].detach()
            if entry.expert is None:
                yield from _hf_tensors(entry, _tp_gather(param, topology), hf_config)
                continue
            # a routed expert: each expert-parallel rank holds another expert in this slot
            whole = torch.cat(
                _tp_gather(param, topology, expert=True), dim=int(entry.kind == "row")
            )
            per_ep_rank = _all_gather(whole, topology.ep_size, topology.groups.ep)
            for ep_entry, tensor in zip(_expert_parallel_entries(entry, topology), per_ep_rank):
                shards = list(tensor.chunk(topology.etp_size, dim=int(entry.kind == "row")))
                yield from _hf_tensors(ep_entry, shards, hf_config)


def _stage_hf_state_dict(
    chunks: Sequence[torch.nn.Module], hf_config: Any, topology: Topology, params_of: ParamsOf
) -> dict[str, torch.Tensor]:
    """CPU copies of `stage_hf_tensors`."""
    tensors = stage_hf_tensors(chunks, hf_config, topology, params_of)
    return {name: _host_copy(t) for name, t in tensors}


def check_export_names(names: set[str], hf_config: Any) -> None:
    """Refuse an export that misses or adds a name (the conversion's name map is incomplete)."""
    expected = expected_hf_names(hf_config)
    missing, extra = sorted(set(expected) - names), sorted(names - set(expected))
    if missing or extra:
        raise RuntimeError(
            f"Megatron -> HF export of model_type={hf_config.model_type!r}: "
            f"{len(missing)} HF tensor(s) left unset (first {missing[:1]}), {len(extra)} not in "
            f"the HF model (first {extra[:1]}); the conversion's name map is incomplete"
        )


@torch.no_grad()
def export_hf_state_dict(
    chunks: Sequence[torch.nn.Module],
    hf_config: Any,
    topology: Topology,
    params_of: ParamsOf = own_parameters,
) -> dict[str, torch.Tensor]:
    """The full HF state dict (CPU tensors, parameter dtype) on every rank, in HF key order.

    TP shards are all-gathered, then each pipeline stage broadcasts its tensors to the other
    stages of its pipeline group, one tensor at a time on the parameters' device (NCCL needs
    CUDA tensors; the collectives' objects need ``torch.cuda.set_device`` done under NCCL).
    """
    full = _stage_hf_state_dict(chunks, hf_config, topology, params_of)
    if topology.pp_size > 1:
        group = topology.groups.pp
        device = next(chunks[0].parameters()).device
        metas: list[Any] = [None] * topology.pp_size
        dist.all_gather_object(
            metas, [(n, tuple(t.shape), t.dtype) for n, t in full.items()], group=group
        )
        for stage, meta in enumerate(metas):
            src = dist.get_global_rank(group, stage)
            for name, shape, dtype in meta:
                if stage == topology.pp_rank:
                    buf = full[name].to(device)
                else:
                    buf = torch.empty(shape, dtype=dtype, device=device)
                dist.broadcast(buf, src=src, group=group)
                if stage != topology.pp_rank:
                    full[name] = _host_copy(buf)
    check_export_names(set(full), hf_config)
    return {name: full[name] for name in expected_hf_names(hf_config)}


def save_hf(
    path: str | Path,
    chunks: Sequence[torch.nn.Module],
    hf_config: Any,
    topology: Topology,
    *,
    max_shard_size: str = "5GB",
    params_of: ParamsOf = own_parameters,
) -> None:
    """Write the model as a Hugging Face folder (safetensors + config.json) from rank 0, loadable
    by ``AutoModelForCausalLM.from_pretrained``. Every rank must call it (it gathers)."""
    from unirl.backends.megatron.weights.hf_io import write_hf_folder

    state = export_hf_state_dict(chunks, hf_config, topology, params_of)
    if topology.rank == 0:
        write_hf_folder(path, state, hf_config, max_shard_size=max_shard_size)
    if dist.is_initialized():
        dist.barrier()
