"""``routed_experts``: the experts a mixture-of-experts model routed each token of a sample to,
for routing replay (``algorithm.routing_replay``).

**Convention (a sample).** An integer array ``[prompt + response - 1, moe_layers, top_k]``: row
``j`` holds, for each MoE layer in layer order, the ``top_k`` experts token ``j`` of the sample
(prompt tokens first, then response tokens) was routed to when the model read it. The last
response token has no row: it is sampled, never read, and its routing reaches no log-prob (its
logits predict nothing; under the causal mask no other token sees it). These are the rows vLLM
returns (``enable_return_routed_experts``: one row per token it ran, ``num_tokens - 1``); its layer
axis holds every decoder layer by layer id (dense layers unwritten), which `select_moe_layers`
cuts to the MoE layers at the engine boundary (the same array when every layer is sparse, as in
Qwen3-30B-A3B). Prompt rows are needed: a prompt token's experts shape the hidden states every
response token attends to.

**Packed (a microbatch).** `pack_routed_experts` lays the rows of the packed samples along the
packed token stream: position ``t`` holds the experts of input token ``t`` (which is also logit
position ``t``, so no shift), and the last position of each sequence holds `FREE` (-1): the
trainer's router chooses there, as it does at context-parallel padding. `unpack_routed_experts`
is the inverse, for experts a forward recorded (R2), back to one array per sample.

The order of the rows is the token order, not the engine's or the trainer's batch order: packing
moves the rows with their tokens (tests/unit/test_routed_experts.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from unirl.core.errors import RolloutDataError

FIELD = "routed_experts"
# A position with no replayed experts: the router's own top-k is used there.
FREE = -1
DTYPE = torch.int32  # 4 bytes per decision (an expert index): 1.5 KiB per token at 48 x top-8


@attrs.frozen(kw_only=True)
class MoeShape:
    """The routing shape of a mixture-of-experts model (read from its config by
    `unirl.core.config.model_shape`)."""

    num_experts: int
    top_k: int  # experts per token
    # Hugging Face layer indices that hold a sparse MoE block, ascending; the i-th MoE layer of
    # ``routed_experts`` is layer ``moe_layers[i]``.
    moe_layers: tuple[int, ...]
    # Whether the top-k weights are renormalised to sum to 1 (Hugging Face's norm_topk_prob).
    norm_topk_prob: bool

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)


_WANT = (
    "give an integer array [prompt + response - 1, moe_layers, top_k] of expert indices (one "
    "row per token the model read: every prompt token and every response token but the last)"
)


def convert_routed_experts(value: Any) -> torch.Tensor | None:
    """A nested list, numpy array or tensor to a ``[N, layers, top_k]`` int32 CPU tensor; raises
    `RolloutDataError` naming the field for anything else."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        if isinstance(value, (str, bytes, bool)) or not hasattr(value, "__len__"):
            raise RolloutDataError(f"field '{FIELD}' is {type(value).__name__}; {_WANT}")
        if hasattr(value, "__array__"):
            try:
                value = torch.as_tensor(value)
            except (TypeError, ValueError, RuntimeError):
                raise RolloutDataError(f"field '{FIELD}' is not a numeric array; {_WANT}") from None
        else:
            value = _nested_to_tensor(value)
    if value.dtype == torch.bool or value.dtype.is_floating_point or value.is_complex():
        raise RolloutDataError(f"field '{FIELD}' is a {value.dtype} array; {_WANT}")
    if value.dim() != 3:
        raise RolloutDataError(
            f"field '{FIELD}' has shape {tuple(value.shape)}, not 3 dimensions; {_WANT}"
        )
    if value.numel() and (int(value.min()) < torch.iinfo(DTYPE).min or int(value.max()) >= 2**31):
        raise RolloutDataError(f"field '{FIELD}' holds an index outside int32; {_WANT}")
    return value.detach().to(device="cpu", dtype=DTYPE)


def _nested_to_tensor(value: Sequence[Any]) -> torch.Tensor:
    if len(value) == 0:
        return torch.zeros(0, 0, 0, dtype=DTYPE)

    def ints(x: Any) -> bool:
        if isinstance(x, (list, tuple)):
            return all(ints(v) for v in x)
        return isinstance(x, int) and not isinstance(x, bool)

    if not ints(value):
        raise RolloutDataError(f"field '{FIELD}' holds a non-integer entry; {_WANT}")
    try:
        return torch.tensor(value, dtype=torch.int64)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise RolloutDataError(
            f"field '{FIELD}' is ragged (rows of different lengths) or too large; {_WANT}"
        ) from None


def select_moe_layers(experts_nlk: Any, shape: MoeShape) -> torch.Tensor:
    """An engine's ``[N, decoder layers, top_k]`` array (vLLM indexes by layer id, dense layers
    included) as the contract's ``[N, moe_layers, top_k]``; an array that already has one column
    per MoE layer is returned as it is."""
    tensor = convert_routed_experts(experts_nlk)
    assert tensor is not None
    layers = tensor.shape[1]
    if layers == shape.num_moe_layers:
        return tensor
    if layers <= shape.moe_layers[-1]:
        raise RolloutDataError(
            f"field '{FIELD}' has {layers} layers, neither the model's {shape.num_moe_layers} MoE "
            f"layers nor its decoder layers up to {shape.moe_layers[-1]}; check the engine's model"
        )
    return tensor[:, list(shape.moe_layers)]


def expected_rows(prompt_length: int, response_length: int) -> int:
    """Rows a sample's ``routed_experts`` has: every token but the last."""
    return prompt_length + response_length - 1


def routed_experts_problems(
    experts: torch.Tensor, prompt_length: int, response_length: int, shape: MoeShape | None
) -> list[str]:
    """What is wrong with one sample's ``routed_experts``: rows against its lengths; with the
    model's `shape` (routing replay on), layers, top-k, the expert range and repeats."""
    rows = expected_rows(prompt_length, response_length)
    got = tuple(experts.shape)
    if got[0] != rows:
        return [
            f"field '{FIELD}' has {got[0]} rows but the sample has {prompt_length} prompt + "
            f"{response_length} response tokens, so {rows} rows (every token but the last)"
        ]
    if shape is None:
        return []
    want = (rows, shape.num_moe_layers, shape.top_k)
    if got != want:
        return [
            f"field '{FIELD}' has shape {list(got)} but the model has {shape.num_moe_layers} MoE "
            f"layers with top_k={shape.top_k}: give shape {list(want)} "
            "[tokens - 1, moe_layers, top_k]"
        ]
    if not experts.numel():
        return []
    bad = ((experts < 0) | (experts >= shape.num_experts)).nonzero()
    if len(bad):
        j, layer, k = (int(x) for x in bad[0])
        return [
            f"field '{FIELD}' has expert {int(experts[j, layer, k])} at token {j}, MoE layer "
            f"{layer}, slot {k}, outside [0, {shape.num_experts}) (the model's num_experts); "
            "check that the engine ran this model"
        ]
    ordered = experts.sort(dim=-1).values
    repeats = (ordered[..., 1:] == ordered[..., :-1]).any(dim=-1).nonzero()
    if len(repeats):
        j, layer = (int(x) for x in repeats[0])
        return [
            f"field '{FIELD}' routes token {j} twice to one expert at MoE layer {layer} "
            f"({experts[j, layer].tolist()}); a token's top-k experts are distinct"
        ]
    return []


def pack_routed_experts(
    per_sample: Sequence[torch.Tensor], lengths: torch.Tensor, cu_seqlens: torch.Tensor
) -> torch.Tensor:
    """The rows of the packed samples along the packed stream ``[T, layers, top_k]``: sample
    ``i``'s rows at its positions, `FREE` at the last position of each sequence."""
    total = int(cu_seqlens[-1])
    layers, top_k = per_sample[0].shape[1:] if per_sample else (0, 0)
    out = torch.full((total, layers, top_k), FREE, dtype=DTYPE)
    if not per_sample:
        return out
    seq = torch.repeat_interleave(torch.arange(len(per_sample)), lengths)
    last = cu_seqlens[1:].to(torch.long) - 1
    keep = torch.ones(total, dtype=torch.bool)
    keep[last] = False
    out[keep] = torch.cat(list(per_sample)).to(DTYPE)
    assert int(keep.sum()) == sum(int(e.shape[0]) for e in per_sample) and seq.numel() == total
    return out


def unpack_routed_experts(packed_t: torch.Tensor, cu_seqlens: torch.Tensor) -> list[torch.Tensor]:
    """Per packed sequence, its rows of a ``[T, layers, top_k]`` tensor (e.g. the experts a
    forward recorded), the last position dropped: the sample convention."""
    bounds = cu_seqlens.to(torch.long).tolist()
    return [
        packed_t[a : b - 1].to(device="cpu", dtype=DTYPE) for a, b in itertools.pairwise(bounds)
    ]


def recorded_per_sample(
    packs: Sequence[Any], recorded: Sequence[torch.Tensor]
) -> dict[int, torch.Tensor]:
    """R2: the experts a recording forward chose, per batch sample index: ``packs`` are the
    `PackedMicrobatch` es it ran (this data-parallel rank's), ``recorded`` its
    ``[T, moe_layers, top_k]`` per microbatch in the packed (global, CP-gathered) order. Attach
    them with `RolloutBatch.with_routed_experts` once every rank's samples are collected."""
    out: dict[int, torch.Tensor] = {}
    for packed, experts_t in zip(packs, recorded, strict=True):
        if packed.num_tokens == 0:
            continue
        if experts_t.shape[0] != packed.num_tokens:
            raise RolloutDataError(
                f"recorded routing has {experts_t.shape[0]} rows for a microbatch of "
                f"{packed.num_tokens} tokens; record in the packed token order (CP pieces gathered)"
            )
        rows = unpack_routed_experts(experts_t, packed.cu_seqlens)
        out.update(zip(packed.sample_indices, rows))
    return out
