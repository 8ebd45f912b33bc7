"""``parallel.sequence_parallel`` without Transformer Engine or Apex (megatron-core 0.16.1).

Megatron's sequence parallel splits the activations BETWEEN the tensor-parallel matmuls (norms,
residual adds) along the sequence across the TP ranks: the embedding scatters its output, each
column-parallel linear all-gathers its input and each row-parallel one reduce-scatters its output
(megatron-core does all of this when ``TransformerConfig.sequence_parallel`` is set). What the
local layer spec lacks is a norm that accepts it: megatron-core 0.16.1's `WrappedTorchNorm`
asserts ``not config.sequence_parallel`` (TE's and Apex's norms are the only ones marked for it).

A norm under sequence parallel is an ordinary per-token norm on the local tokens; the one thing
that changes is its weight's gradient, which each rank computes from its own tokens only. Megatron
sums those over the TP group for every parameter marked ``sequence_parallel = True``
(``finalize_model_grads._allreduce_non_tensor_model_parallel_grads``, which runs when
``config.sequence_parallel`` is set), so `SequenceParallelNorm` is `WrappedTorchNorm` with that
mark and without the assertion. The norms of a layer are in its spec; the decoder's final norm is
the block's ``layer_norm``, which megatron-core reads from a module global unless the block's
submodules are given: `sequence_parallel_block` gives them (the layer count per chunk is megatron's
own `get_num_layers_to_build`).

What reaches the sequence split: packed streams and padded rows are padded to a multiple of the TP
size (`sequence_multiple`; padding tokens are never read). The LM head's column-parallel layer
gathers its input itself; ``model.fused_head``'s hidden states are gathered by `gather_hidden`.
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

from unirl.core.config.run_config import ParallelConfig


class SequenceParallelNorm:
    """megatron-core 0.16.1's `WrappedTorchNorm` (``transformer/torch_norm.py``) for sequence
    parallel: the same torch ``RMSNorm`` / ``LayerNorm``, its parameters marked
    ``sequence_parallel`` so megatron sums their gradients over the TP group."""

    def __new__(  # type: ignore[misc]
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        assert not config.layernorm_zero_centered_gamma, "torch norms have no zero-centred gamma"
        assert not config.persist_layer_norm and not config.memory_efficient_layer_norm
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        norm = kinds[config.normalization](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
        return norm


def sequence_parallel_block(
    layer: ModuleSpec, config: TransformerConfig, vp_stage: int | None
) -> TransformerBlockSubmodules:
    """The decoder block of one chunk with `SequenceParallelNorm` for every norm: the layer's and
    the block's final one (what `TransformerBlock` would build from ``layer`` otherwise)."""
    from megatron.core import parallel_state as ps

    layers = get_num_layers_to_build(config, vp_stage, ps.get_pipeline_model_parallel_rank())
    return sequence_parallel_norms(TransformerBlockSubmodules(layer_specs=[layer] * layers))


def sequence_parallel_norms(block: TransformerBlockSubmodules) -> TransformerBlockSubmodules:
    """``block`` (a local-spec block: dense layers or megatron's MoE decoder block spec) with
    `SequenceParallelNorm` in every norm slot that holds a torch norm: each layer's input and
    pre-MLP norms, its attention's per-head q / k norms (Qwen3; their gradients megatron already
    sums over TP by name, the mark changes nothing there) and the block's final norm. Layer specs
    shared between layers are changed once, in place, as megatron's own spec helpers do."""
    slots = ("input_layernorm", "pre_mlp_layernorm")
    for layer in block.layer_specs:
        sub = layer.submodules
        for slot in slots:
            if getattr(sub, slot) is not IdentityOp:
                setattr(sub, slot, SequenceParallelNorm)
        attention = sub.self_attention.submodules
        for slot in ("q_layernorm", "k_layernorm"):
            if getattr(attention, slot) is not IdentityOp:
                setattr(attention, slot, SequenceParallelNorm)
    block.layer_norm = SequenceParallelNorm
    return block


def sequence_multiple(parallel: ParallelConfig) -> int:
    """What a model input's sequence length must be a multiple of: the TP size under sequence
    parallel (each rank holds an equal slice), else 1."""
    return parallel.tp if parallel.sequence_parallel else 1


def gather_hidden(hidden_sbh: torch.Tensor) -> torch.Tensor:
    """The whole sequence's hidden states from this rank's slice (all-gather over TP along the
    sequence). Backward keeps this rank's slice of the gradient, unsummed: core's fused head
    already sums the vocabulary shards' parts of it over TP (`logprobs_from_hidden`,
    `head_loss`), so every rank holds the whole gradient."""
    return tensor_parallel.gather_from_sequence_parallel_region(
        hidden_sbh, tensor_parallel_output_grad=False
    )


def install_cpu_rng_tracker() -> None:
    """On the CPU: megatron's RNG tracker as its inference variant, whose ``fork()`` does nothing.
    Under sequence parallel the decoder forks the CUDA RNG state (so dropout masks differ between
    the ranks' sequence slices); with no CUDA state to fork and dropout off (`transformer_config`)
    there is nothing to keep apart."""
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
