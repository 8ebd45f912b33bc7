"""Where each Hugging Face LoRA target's output sits in the Megatron linear it adapts.

Megatron fuses q / k / v into ``linear_qkv`` (per key/value group: the group's query heads, its
key head, its value head; a tensor-parallel rank holds whole groups) and gate / up into
``linear_fc1`` (``[gate_r; up_r]`` on rank r), see `unirl.backends.megatron.weights.hf_layout`.
An adapter per HF target keeps the exported adapter PEFT's (one ``lora_A`` / ``lora_B`` per HF
module): each target's local output ``[..., out_t / tp]`` (its B's rows of this rank, a plain
row block in HF order for every target here) is placed into the fused layout by `FusedLayout`.
The same placement on a transposed weight delta gives the merged weight's fused shard."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

# megatron linear (inside a decoder layer) -> the HF targets it holds, in its fused order
ATTENTION_TARGETS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",)}
MLP_TARGETS = {"linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
# The HF module (under ``model.layers.{i}.``) of each target
HF_MODULE = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}
# The LM head (megatron's ``output_layer``, vocabulary-parallel, on the last pipeline stage): its
# HF module is ``lm_head`` itself, and its B has megatron's padded vocabulary rows.
HEAD = "lm_head"
ADAPTABLE = (*HF_MODULE, HEAD)
# An adapted linear's branch is its sibling module ``<linear>_lora`` (`install`)
SUFFIX = "_lora"


def is_adapter_parameter(name: str) -> bool:
    """Whether a chunk's parameter name is an adapter's (``...linear_qkv_lora.lora_A.q_proj``)."""
    return f"{SUFFIX}.lora_" in name


@attrs.frozen
class FusedLayout:
    """The targets of one linear in its fused order, each target's local output width, and the
    number of key/value groups on this rank (``linear_qkv`` only; None: targets side by side)."""

    targets: tuple[str, ...]
    widths: tuple[int, ...]
    groups: int | None = None

    def fuse(self, outputs: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """The fused local output ``[..., sum(widths)]`` from each target's ``[..., width]``
        (None: a target without an adapter, zeros)."""
        ref = next(o for o in outputs if o is not None)
        parts = [
            o if o is not None else ref.new_zeros(*ref.shape[:-1], w)
            for o, w in zip(outputs, self.widths)
        ]
        if self.groups is None:
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        lead = ref.shape[:-1]
        grouped = [p.reshape(*lead, self.groups, -1) for p in parts]
        return torch.cat(grouped, dim=-1).reshape(*lead, -1)

    def fuse_rows(self, deltas: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """The fused local weight rows ``[sum(widths), in]`` from each target's ``[width, in]``."""
        return self.fuse([None if d is None else d.t() for d in deltas]).t()
