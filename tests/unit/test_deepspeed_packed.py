"""The packed forward of the DeepSpeed backend (`unirl.backends.hf.packed`): logits and
parameter gradients of one packed stream equal those of each sequence run alone through an
unmodified transformers model (its own SDPA attention) — on the CPU (SDPA per bucket of similar
lengths, right-padded; one bucket or several) and,
on a GPU, through flash varlen attention in bf16. Unsupported attention features are refused."""

from __future__ import annotations

import itertools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from unirl.backends.hf.packed import (  # noqa: E402
    _varlen_attn,
    bucket_plan,
    forward_packed,
    use_packed_attention,
)
from unirl.core.data.microbatch import TrainMicrobatch  # noqa: E402
from unirl.core.errors import ConfigError  # noqa: E402

HF_CONFIG = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=50,
    max_position_embeddings=128,
)
LENGTHS = [7, 1, 30, 2, 64]  # incl. a one-token sequence


def _models(dtype: torch.dtype, device: str, config: dict = HF_CONFIG):
    """Two copies of the same weights: the packed one and an untouched reference."""

    def build():  # each model its own config object: switching attention must not touch the other
        return transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**config), attn_implementation="sdpa"
        )

    torch.manual_seed(0)
    ref, packed = build(), build()
    packed.load_state_dict(ref.state_dict())
    use_packed_attention(packed)
    assert ref.config._attn_implementation == "sdpa"
    return packed.to(device, dtype), ref.to(device, dtype)


def _microbatch(lengths, vocab: int) -> TrainMicrobatch:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (sum(lengths),), generator=g)
    positions = torch.cat([torch.arange(0), *(torch.arange(n) for n in lengths)])
    seq_ids = torch.cat(
        [torch.zeros(0, dtype=torch.long), *(torch.full((n,), i) for i, n in enumerate(lengths))]
    )
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    return TrainMicrobatch(
        sample_indices=tuple(range(len(lengths))),
        tokens=tokens,
        position_ids=positions,
        cu_seqlens=cu,
        targets=tokens,  # unused here
        loss_mask=torch.ones(len(tokens)),
        seq_ids=seq_ids,
        seq_token_counts=torch.tensor(lengths),
    )


def _compare(
    dtype: torch.dtype, device: str, logit_tol: float, grad_tol: float, lengths=LENGTHS
) -> None:
    packed, ref = _models(dtype, device)
    mb = _microbatch(lengths, HF_CONFIG["vocab_size"])
    weights = torch.randn(
        mb.num_tokens, HF_CONFIG["vocab_size"], generator=torch.Generator().manual_seed(2)
    )
    weights = weights.to(device)

    logits = forward_packed(packed, mb, torch.device(device))
    (logits.float() * weights).sum().backward()

    bounds = mb.cu_seqlens.tolist()
    ref_logits = []
    for a, b in itertools.pairwise(bounds):
        out = ref(input_ids=mb.tokens[a:b][None].to(device), use_cache=False).logits[0]
        (out.float() * weights[a:b]).sum().backward()  # gradients accumulate over sequences
        ref_logits.append(out.detach())
    expected = torch.cat(ref_logits)
    assert logits.shape == expected.shape
    rel = ((logits.detach().float() - expected.float()).norm() / expected.float().norm()).item()
    assert rel < logit_tol
    ref_params = dict(ref.named_parameters())
    for name, p in packed.named_parameters():
        g, r = p.grad.float(), ref_params[name].grad.float()
        assert ((g - r).norm() / r.norm()).item() < grad_tol, name


def test_packed_equals_per_sequence_on_cpu():
    _compare(torch.float32, "cpu", logit_tol=1e-6, grad_tol=1e-5)


def test_packed_in_several_length_buckets_equals_per_sequence_on_cpu():
    # 90^2 - 64^2 = 4004 <= 64^2 < 90^2 - 30^2: two padded SDPA calls, [90, 64] and [30, 7, 2, 1]
    lengths = [7, 90, 1, 30, 2, 64]
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    assert [(b.rows, b.length) for b in bucket_plan(cu).buckets] == [(2, 90), (4, 30)]
    _compare(torch.float32, "cpu", logit_tol=1e-6, grad_tol=1e-5, lengths=lengths)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_varlen_equals_per_sequence_on_gpu():
    if _varlen_attn() is None:
        pytest.skip("needs torch.nn.attention.varlen (torch >= 2.9)")
    # bf16: both sides round activations to bf16 (relative step 2**-8) in different orders
    _compare(torch.bfloat16, "cuda", logit_tol=2e-2, grad_tol=5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_buckets_equal_per_sequence_on_gpu_fp32():
    # fp32 on a GPU takes the bucketed SDPA path too (varlen flash attention is bf16/fp16 only)
    _compare(torch.float32, "cuda", logit_tol=1e-5, grad_tol=1e-4, lengths=[7, 90, 1, 30, 2, 64])


def test_empty_microbatch_runs_one_pad_token():
    packed, _ = _models(torch.float32, "cpu")
    empty = _microbatch([], HF_CONFIG["vocab_size"])
    assert forward_packed(packed, empty, torch.device("cpu")).shape == (1, HF_CONFIG["vocab_size"])


def test_sliding_window_longer_than_a_sequence_is_refused():
    config = {**HF_CONFIG, "model_type": "mistral", "sliding_window": 16}
    packed, _ = _models(torch.float32, "cpu", config)
    forward_packed(packed, _microbatch([16, 5], 50), torch.device("cpu"))  # within the window
    with pytest.raises(ConfigError, match="sliding window of 16 tokens and a sequence here has 17"):
        forward_packed(packed, _microbatch([17, 5], 50), torch.device("cpu"))
