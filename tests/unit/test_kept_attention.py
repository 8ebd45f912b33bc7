"""Activation recompute keeping attention's output (``model.recompute_attention: false``,
`unirl.backends.kept_attention`): the gradients equal plain autograd's (no checkpoint at all),
the attention kernel runs once per layer where whole-layer recompute runs it twice (counted at
the aten level: a kernel served from the checkpoint's cache is not a call), the Hugging Face
backends' layers take it from the config, the config refuses it where it changes nothing, and
`unirl check` prints the kept memory, computed here by hand."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tests.attention_calls import AttentionCalls
from tests.tiny_models import TINY_LLAMA
from unirl.backends.kept_attention import checkpoint_keeping_attention
from unirl.core.config.run_config import load_config
from unirl.core.errors import ConfigError

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny_grpo.yaml"


class Block(torch.nn.Module):
    """A pre-norm decoder layer in plain PyTorch: attention (causal SDPA) and an MLP."""

    def __init__(self, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(F.layer_norm(x, (w,))).view(b, t, 3, self.heads, -1).unbind(2)
        att = F.scaled_dot_product_attention(
            *(z.transpose(1, 2) for z in (q, k, v)), is_causal=True
        )
        x = x + self.out(att.transpose(1, 2).reshape(b, t, w))
        return x + self.down(F.gelu(self.up(F.layer_norm(x, (w,)))))


def _run(blocks, x, wrap):
    x = x.clone().requires_grad_()
    calls = AttentionCalls()
    with calls:
        h = x
        for block in blocks:
            h = wrap(block, h)
        (h.square().sum()).backward()
    grads = [p.grad.clone() for b in blocks for p in b.parameters()]
    for b in blocks:
        b.zero_grad(set_to_none=True)
    return grads, x.grad, calls.forward


def test_kept_attention_gives_autograds_gradients_and_runs_attention_once():
    torch.manual_seed(0)
    blocks = [Block(), Block()]
    x = torch.randn(2, 12, 16)
    ref, ref_x, plain_calls = _run(blocks, x, lambda b, h: b(h))
    kept, kept_x, kept_calls = _run(blocks, x, lambda b, h: checkpoint_keeping_attention(b, h))
    whole, _, whole_calls = _run(blocks, x, lambda b, h: checkpoint(b, h, use_reentrant=False))
    for a, r in zip(kept, ref, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kept_x, ref_x, rtol=1e-6, atol=1e-6)
    # one attention kernel per layer in forward (2 layers), none again in backward
    assert plain_calls == 2
    assert kept_calls == 2
    assert whole_calls == 4  # whole-layer recompute runs each layer's attention twice
    for a, r in zip(whole, ref, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-6)


def test_forward_only_runs_without_a_checkpoint(monkeypatch):
    from unirl.backends import kept_attention

    def no_checkpoint(*args, **kwargs):
        raise AssertionError("a forward-only pass went through the checkpoint")

    monkeypatch.setattr(kept_attention, "checkpoint", no_checkpoint)
    block = Block()
    x = torch.randn(1, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(checkpoint_keeping_attention(block, x), block(x))
    with pytest.raises(AssertionError, match="went through the checkpoint"):
        checkpoint_keeping_attention(block, x)  # with autograd: the checkpoint


def _hf_grads(recompute_attention: bool | None):
    from unirl.backends.causal_lm import load_policy
    from unirl.core.config.run_config import ModelConfig

    hf = {**TINY_LLAMA, "vocab_size": 50, "num_hidden_layers": 3}
    extra = (
        {}
        if recompute_attention is None
        else {"gradient_checkpointing": True, "recompute_attention": recompute_attention}
    )
    model = load_policy(ModelConfig(hf_config=hf, init_seed=3, **extra))
    tokens = torch.randint(0, 50, (1, 20), generator=torch.Generator().manual_seed(1))
    calls = AttentionCalls()
    with calls:
        logits = model(tokens).logits
        torch.log_softmax(logits.float(), -1)[0, :-1].gather(
            1, tokens[0, 1:, None]
        ).sum().backward()
    return {n: p.grad for n, p in model.named_parameters()}, calls.forward


def test_hugging_face_layers_keep_attention_from_the_config():
    ref, plain = _hf_grads(None)  # no checkpoint: plain autograd
    kept, kept_calls = _hf_grads(False)
    whole, whole_calls = _hf_grads(True)
    assert plain == 3 and kept_calls == 3 and whole_calls == 6
    for name, r in ref.items():
        torch.testing.assert_close(kept[name], r, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(whole[name], r, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (
            ["model.recompute_attention=false"],
            "model.recompute_attention: false keeps attention's output in the layers "
            "model.gradient_checkpointing recomputes, which is off",
        ),
        (
            [
                "model.gradient_checkpointing=true",
                "model.recompute_attention=false",
                "model.hf_config.model_type=qwen3_moe",
                "model.hf_config.num_experts=4",
                "model.hf_config.num_experts_per_tok=2",
                "model.hf_config.moe_intermediate_size=8",
            ],
            "model.recompute_attention: false with a mixture-of-experts model",
        ),
        (
            [
                "backend=deepspeed",
                "parallel.zero_stage=3",
                "model.gradient_checkpointing=true",
                "model.recompute_attention=false",
            ],
            "model.recompute_attention: false with backend: deepspeed and parallel.zero_stage: 3",
        ),
    ],
)
def test_settings_that_change_nothing_are_refused_naming_the_key(overrides, words):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, overrides)
    assert words in str(err.value)


def test_check_prints_the_kept_memory_computed_by_hand():
    from unirl.cli import check_report

    qwen3_4b = (
        "{model_type: qwen3, hidden_size: 2560, intermediate_size: 9728, num_hidden_layers: 36,"
        " num_attention_heads: 32, num_key_value_heads: 8, head_dim: 128, vocab_size: 151936}"
    )
    cfg = load_config(
        TINY,
        [
            f"model.hf_config={qwen3_4b}",
            "model.dtype=bf16",
            "model.max_seq_len=65536",
            "batch.micro_batch_size=null",
            "batch.max_tokens_per_microbatch=65536",
            "model.gradient_checkpointing=true",
            "model.recompute_attention=false",
        ],
    )
    note = check_report(cfg)["recompute"]
    # 36 layers x 65,536 tokens x 32 heads x (128 x 2 bytes + 4 bytes of statistics)
    expected = 36 * 65536 * 32 * (128 * 2 + 4) / 2**30
    assert f"{expected:.2f} GiB per rank and microbatch (36 layers x 65,536 tokens)" in note, note
    assert "model.recompute_attention: false" in note
    whole = check_report(load_config(TINY, ["model.gradient_checkpointing=true"]))["recompute"]
    assert "attention included" in whole


class _PackedLayer(torch.nn.Module):
    """q / k / v projections around Megatron's packed attention (flash varlen or cuDNN)."""

    def __init__(self, cu: torch.Tensor, heads: int = 4, kv: int = 2, dim: int = 128) -> None:
        super().__init__()
        self.cu, self.heads, self.kv, self.dim = cu, heads, kv, dim
        width = heads * dim
        self.q = torch.nn.Linear(width, width, bias=False)
        self.kv_proj = torch.nn.Linear(width, 2 * kv * dim, bias=False)
        self.o = torch.nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from unirl.backends.megatron.kernels.varlen_attention import packed_causal_attention

        t = x.shape[0]
        q = self.q(x).view(t, self.heads, self.dim)
        k, v = self.kv_proj(x).view(t, 2, self.kv, self.dim).unbind(1)
        return x + self.o(packed_causal_attention(q, k, v, self.cu).reshape(t, -1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (flash / cuDNN kernels)")
@pytest.mark.parametrize("lengths", [[300, 77, 500], [8192, 100]], ids=["flash", "cudnn"])
def test_kept_attention_on_gpu_kernels(monkeypatch, lengths):
    """On the GPU's kernels (flash varlen for short packs, cuDNN from 8,192 tokens, its probe
    not yet run: `keep_attention_in` runs it before the checkpoint), bf16: the gradients equal
    plain autograd's up to the kernels' nondeterministic backward (one H100: at most 3e-8 apart;
    a probe inside the checkpoint failed here with a wrong-shaped cached output), attention
    runs once per layer."""
    from unirl.backends import cudnn_attention as ca
    from unirl.backends.kept_attention import keep_attention_in
    from unirl.backends.megatron.kernels import varlen_attention as va

    monkeypatch.setenv("UNIRL_CUDNN_ATTENTION", "1")
    monkeypatch.setattr(ca, "_WORKS", {})
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32).cuda()
    torch.manual_seed(0)
    layers = [_PackedLayer(cu).cuda().bfloat16() for _ in range(2)]
    x = torch.randn(sum(lengths), 512, device="cuda", dtype=torch.bfloat16)

    def run():
        calls = AttentionCalls()
        inp = x.clone().requires_grad_()
        with calls:
            h = inp
            for layer in layers:
                h = layer(h)
            h.float().square().mean().backward()
        grads = [p.grad.clone() for m in layers for p in m.parameters()] + [inp.grad]
        for m in layers:
            m.zero_grad(set_to_none=True)
        return grads, calls.forward

    va.probe_ahead(x, 128)  # outside the counted runs
    ref, plain_calls = run()
    for layer in layers:
        keep_attention_in(layer, functools.partial(va.probe_ahead, head_dim=128))
    # the first kept run probes (in the wrapper): cuDNN's and torch 2.11's grouped-heads check
    monkeypatch.setattr(ca, "_WORKS", {})
    monkeypatch.setattr(va, "_NATIVE_GQA", {})
    kept, _ = run()
    for a, b in zip(kept, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1.6e-2, atol=1e-6)
    _, kept_calls = run()  # probed: only the layers' attention counted
    # once per layer and sequence (flash: one call per pack). On the H100 a plain run that
    # probed torch 2.11's grouped heads inside it counted the probe's two calls (4 != 2): the
    # probes now run ahead, outside the counted runs.
    expected = 2 * (len(lengths) if lengths[0] >= 8192 else 1)
    assert kept_calls == plain_calls == expected
