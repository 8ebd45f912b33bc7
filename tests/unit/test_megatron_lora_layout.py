"""Where each Hugging Face LoRA target's output lands in Megatron's fused linears
(`unirl.backends.megatron.lora.layout`), by hand; and the targets the backend refuses."""

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core (pip install unirl[megatron])",
)


def test_qkv_outputs_interleave_per_group_by_hand():
    from unirl.backends.megatron.lora.layout import FusedLayout

    # 2 key/value groups on this rank, 2 query heads per group, head_dim 1:
    # q = [q0 q1 | q2 q3], k = [k0 | k1], v = [v0 | v1]
    layout = FusedLayout(("q_proj", "k_proj", "v_proj"), (4, 2, 2), groups=2)
    q = torch.tensor([[10.0, 11, 12, 13]])
    k = torch.tensor([[20.0, 21]])
    v = torch.tensor([[30.0, 31]])
    # megatron's rows: group 0's q heads, its k, its v; then group 1's
    assert layout.fuse([q, k, v]).tolist() == [[10, 11, 20, 30, 12, 13, 21, 31]]
    # a target without an adapter contributes zeros in its place
    assert layout.fuse([q, None, v]).tolist() == [[10, 11, 0, 30, 12, 13, 0, 31]]


def test_gate_up_outputs_side_by_side_by_hand():
    from unirl.backends.megatron.lora.layout import FusedLayout

    layout = FusedLayout(("gate_proj", "up_proj"), (2, 2))
    out = layout.fuse([torch.tensor([[1.0, 2]]), torch.tensor([[3.0, 4]])])
    assert out.tolist() == [[1, 2, 3, 4]]
    assert layout.fuse([None, torch.tensor([[3.0, 4]])]).tolist() == [[0, 0, 3, 4]]


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_rows_are_the_weight_conversions_shard(tp):
    """Per-target weight rows fused by the layout are the shard the HF -> Megatron conversion
    gives the fused weight (so a merged delta adds onto the right rows)."""
    from unirl.backends.megatron.lora.layout import FusedLayout
    from unirl.backends.megatron.weights.hf_layout import fuse_gate_up, shard_qkv

    heads, groups, d, hidden, ffn = 4, 2, 3, 5, 6
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n * d, hidden, generator=gen) for n in (heads, groups, groups))
    gate, up = torch.randn(ffn, hidden, generator=gen), torch.randn(ffn, hidden, generator=gen)
    for rank in range(tp):
        qkv = FusedLayout(
            ("q_proj", "k_proj", "v_proj"),
            (heads // tp * d, groups // tp * d, groups // tp * d),
            groups=groups // tp,
        )
        rows = qkv.fuse_rows([t.chunk(tp)[rank] for t in (q, k, v)])
        want = shard_qkv(q, k, v, num_query_groups=groups, tp_size=tp, tp_rank=rank)
        assert torch.equal(rows, want)
        fc1 = FusedLayout(("gate_proj", "up_proj"), (ffn // tp, ffn // tp))
        rows = fc1.fuse_rows([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
        assert torch.equal(rows, fuse_gate_up(gate, up, tp_size=tp, tp_rank=rank))


def test_a_target_the_backend_cannot_adapt_is_a_config_error():
    from unirl.backends.megatron.lora.install import check_targets
    from unirl.core.config.sections.lora import LoraConfig
    from unirl.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"\['embed_tokens'\] cannot be adapted by the Megatron"):
        check_targets(LoraConfig(target_modules=("q_proj", "embed_tokens")))
    check_targets(LoraConfig())  # every linear of a decoder layer
    check_targets(LoraConfig(target_modules=("q_proj", "lm_head")))  # and the LM head
