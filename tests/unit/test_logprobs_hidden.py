"""logprobs_from_hidden on the CPU (the chunked PyTorch path) against plain fp64 PyTorch
(`tests.logprob_reference`): ``log_softmax(h @ W.T / T).gather``, the entropy, and autograd's
gradients for the hidden states and the weight under random upstream gradients of both
outputs."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.logprob_reference import logp_entropy_backward
from unirl.core.errors import LossInputError
from unirl.core.maths.logprobs_hidden import default_chunk_size, logprobs_from_hidden

TEMPERATURE = 0.7


def reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    w_logp: torch.Tensor,
    w_ent: torch.Tensor | None,
    *,
    temperature: float = TEMPERATURE,
    vocab_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """fp64 logits, log_softmax + gather, -sum p log p, and autograd's d/dhidden, d/dweight of
    sum(w_logp logp) + sum(w_ent H)."""
    h = hidden.double().detach().requires_grad_(True)
    w = weight.double().detach().requires_grad_(True)
    logits = h @ w.T / temperature
    if vocab_size is not None:
        logits = logits[:, :vocab_size]
    logp, entropy = logp_entropy_backward(logits, targets, w_logp, w_ent)
    return {"logp": logp, "entropy": entropy, "dh": h.grad, "dw": w.grad}


def make(
    n_tokens: int, hidden_size: int, vocab: int, dtype: torch.dtype, seed: int, n_ids: int
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n_tokens, hidden_size, generator=g)).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=g) / hidden_size**0.5 * 3).to(dtype)
    targets = torch.randint(0, n_ids, (n_tokens,), generator=g)
    w_logp = torch.randn(n_tokens, generator=g)
    w_ent = torch.randn(n_tokens, generator=g)
    return hidden, weight, targets, w_logp, w_ent


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# ||out - ref|| / ||ref||: fp32 arithmetic on the given inputs; bf16 gradients are rounded to
# bf16 (relative step 2**-8)
FWD_TOL = 1e-5
GRAD_TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}


def run(hidden, weight, targets, w_logp, w_ent, **kwargs) -> dict[str, torch.Tensor]:
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    logp, entropy = logprobs_from_hidden(
        h, w, targets, temperature=TEMPERATURE, with_entropy=True, **kwargs
    )
    loss = (w_logp * logp).sum()
    if w_ent is not None:
        loss = loss + (w_ent * entropy).sum()
    loss.backward()
    assert h.grad.dtype == hidden.dtype and w.grad.dtype == weight.dtype
    return {"logp": logp, "entropy": entropy, "dh": h.grad, "dw": w.grad}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 37 columns in chunks of 5 (the last one 2 wide), of 37 (one chunk), and the default
@pytest.mark.parametrize("chunk_size", [5, 37, None])
def test_matches_plain_pytorch(dtype, chunk_size) -> None:
    hidden, weight, targets, w_logp, w_ent = make(13, 16, 37, dtype, seed=1, n_ids=37)
    out = run(hidden, weight, targets, w_logp, w_ent, chunk_size=chunk_size)
    ref = reference(hidden, weight, targets, w_logp, w_ent)
    assert out["logp"].dtype == torch.float32 and out["logp"].shape == (13,)
    assert rel_err(out["logp"], ref["logp"]) < FWD_TOL
    assert rel_err(out["entropy"], ref["entropy"]) < FWD_TOL
    assert rel_err(out["dh"], ref["dh"]) < GRAD_TOL[dtype]
    assert rel_err(out["dw"], ref["dw"]) < GRAD_TOL[dtype]


def test_padded_vocabulary_is_left_out() -> None:
    # rows 29..36 of the weight are padding (Megatron pads the vocabulary): scaled up so that
    # counting them would dominate the softmax
    hidden, weight, targets, w_logp, w_ent = make(11, 8, 37, torch.float32, seed=2, n_ids=29)
    weight[29:] *= 20
    out = run(hidden, weight, targets, w_logp, w_ent, vocab_size=29, chunk_size=4)
    ref = reference(hidden, weight, targets, w_logp, w_ent, vocab_size=29)
    assert rel_err(out["logp"], ref["logp"]) < FWD_TOL
    assert rel_err(out["entropy"], ref["entropy"]) < FWD_TOL
    assert rel_err(out["dh"], ref["dh"]) < 1e-5
    assert rel_err(out["dw"][:29], ref["dw"][:29]) < 1e-5
    assert torch.all(out["dw"][29:] == 0)


def test_entropy_without_gradient() -> None:
    hidden, weight, targets, w_logp, _ = make(9, 8, 20, torch.float32, seed=3, n_ids=20)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    logp, entropy = logprobs_from_hidden(
        h, w, targets, temperature=TEMPERATURE, with_entropy=True, entropy_grad=False, chunk_size=6
    )
    assert not entropy.requires_grad
    (w_logp * logp).sum().backward()
    ref = reference(hidden, weight, targets, w_logp, None)
    assert rel_err(entropy, ref["entropy"]) < FWD_TOL
    assert rel_err(h.grad, ref["dh"]) < 1e-5 and rel_err(w.grad, ref["dw"]) < 1e-5


def test_logprobs_only_and_one_input_with_grad() -> None:
    hidden, weight, targets, w_logp, _ = make(9, 8, 20, torch.float32, seed=4, n_ids=20)
    ref = reference(hidden, weight, targets, w_logp, None, temperature=1.0)
    # only the hidden states need a gradient (a frozen head)
    h = hidden.clone().requires_grad_(True)
    logp = logprobs_from_hidden(h, weight, targets, chunk_size=7)
    assert rel_err(logp, ref["logp"]) < FWD_TOL
    (w_logp * logp).sum().backward()
    assert rel_err(h.grad, ref["dh"]) < 1e-5
    # only the weight does
    w = weight.clone().requires_grad_(True)
    (w_logp * logprobs_from_hidden(hidden, w, targets, chunk_size=7)).sum().backward()
    assert rel_err(w.grad, ref["dw"]) < 1e-5


def test_no_tokens() -> None:
    h = torch.zeros(0, 8, requires_grad=True)
    w = torch.randn(20, 8, requires_grad=True)
    logp, entropy = logprobs_from_hidden(h, w, torch.zeros(0, dtype=torch.long), with_entropy=True)
    assert logp.shape == (0,) and entropy.shape == (0,)
    (logp.sum() + entropy.sum()).backward()
    assert h.grad.shape == (0, 8) and torch.all(w.grad == 0)


class _LargestOutput(TorchDispatchMode):
    """Records the most elements any single op's output held."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_never_holds_more_than_one_chunk_of_logits() -> None:
    n_tokens, hidden_size, vocab, chunk = 64, 8, 512, 32
    hidden, weight, targets, w_logp, w_ent = make(
        n_tokens, hidden_size, vocab, torch.float32, 5, vocab
    )
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    with _LargestOutput() as fused:
        logp, ent = logprobs_from_hidden(h, w, targets, with_entropy=True, chunk_size=chunk)
        ((w_logp * logp).sum() + (w_ent * ent).sum()).backward()
    # the weight's gradient [V, H] is the largest tensor; logits pieces are [T, chunk]
    assert fused.largest == max(vocab * hidden_size, n_tokens * chunk)
    assert fused.largest < n_tokens * vocab / 4
    # the same probe sees the plain form make [T, V] tensors: the check can fail
    with _LargestOutput() as plain:
        torch.log_softmax(h @ w.T, -1).gather(1, targets[:, None]).sum().backward()
    assert plain.largest >= n_tokens * vocab


def test_default_chunk_size() -> None:
    cpu, cuda, bf16, f32 = torch.device("cpu"), torch.device("cuda"), torch.bfloat16, torch.float32
    assert default_chunk_size(1 << 14, cpu, f32) == 1024  # 2**24 elements / 16,384 tokens
    assert default_chunk_size(1 << 30, cpu, f32) == 128  # never below one 128-column tile
    assert default_chunk_size(3000, cpu, f32) % 128 == 0
    # CUDA: 2**28 bytes of fp32 logits + bf16 dz (6 bytes per element) over 16,384 rows = 2,730
    # columns, down to a multiple of 128; at 65,536 rows the 2,048-column floor
    assert default_chunk_size(1 << 14, cuda, bf16) == 2688
    assert default_chunk_size(1 << 16, cuda, bf16) == 2048
    assert default_chunk_size(1 << 12, cuda, f32) == 8192  # 2**28 / (4,096 x 8 bytes)


def test_bad_input_names_the_field() -> None:
    h, w, t = torch.zeros(3, 8), torch.zeros(10, 8), torch.zeros(3, dtype=torch.long)
    with pytest.raises(LossInputError, match="hidden must be a 2-D tensor"):
        logprobs_from_hidden(h[None], w, t)
    with pytest.raises(LossInputError, match="weight has 4 columns"):
        logprobs_from_hidden(h, w[:, :4], t)
    with pytest.raises(LossInputError, match=r"hidden\.to\(weight\.dtype\)"):
        logprobs_from_hidden(h.double(), w, t)
    with pytest.raises(LossInputError, match="targets has 2 tokens but hidden has 3"):
        logprobs_from_hidden(h, w, t[:2])
    with pytest.raises(LossInputError, match=r"targets\[1\] = 9 is outside"):
        logprobs_from_hidden(h, w, torch.tensor([0, 9, 1]), vocab_size=9)
    with pytest.raises(LossInputError, match="chunk_size"):
        logprobs_from_hidden(h, w, t, chunk_size=0)
    with pytest.raises(LossInputError, match="kernel='triton' needs CUDA"):
        logprobs_from_hidden(h, w, t, kernel="triton")
