"""The Triton path of logprobs_from_logits on a CUDA GPU against the fp64 references of
`tests.logprob_reference`: forward, backward, entropy, temperature, padded vocabulary, vocabulary
shards, 64-bit offsets."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.logprob_reference import logits_reference
from unirl.core.maths.logprobs import logprobs_from_logits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and importlib.util.find_spec("triton") is not None),
        reason="needs CUDA and triton",
    ),
]

# ||out - ref|| / ||ref||: fp32 arithmetic (with the GPU's fast exp) on the given inputs; a bf16
# gradient is rounded to bf16 (relative step 2**-8)
FWD_TOL = 2e-5
GRAD_TOL = {torch.float32: 2e-5, torch.bfloat16: 8e-3}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def poison_allocator(n_bytes: int) -> None:
    """Leave NaN in the caching allocator's free blocks, so an unwritten output shows up."""
    blob = torch.full((n_bytes // 4 + 1024,), float("nan"), device="cuda")
    del blob


def make(n_tokens: int, vocab: int, vocab_size: int, dtype: torch.dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(n_tokens, vocab, device="cuda", generator=g) * 3).to(dtype)
    logits[:, vocab_size:] = 60.0  # padding that would dominate the softmax if counted
    targets = torch.randint(0, vocab_size, (n_tokens,), device="cuda", generator=g)
    targets[0] = vocab_size - 1  # the last real id, next to the padding
    w_logp = torch.randn(n_tokens, device="cuda", generator=g)
    w_ent = torch.randn(n_tokens, device="cuda", generator=g)
    return logits, targets, w_logp, w_ent


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("entropy", ["off", "grad", "no_grad"])
@pytest.mark.parametrize(
    ("n_tokens", "vocab", "vocab_size"),
    [(37, 32003, 32003), (64, 32000, 31990), (8, 151936, 151665)],
)
def test_triton_matches_fp64(
    dtype, temperature, entropy, n_tokens, vocab, vocab_size, monkeypatch
) -> None:
    from unirl.core.maths.kernels import logprobs_triton

    calls = {"fwd": 0, "bwd": 0}
    fwd, bwd = logprobs_triton.local_stats, logprobs_triton.logits_grad

    def counting_fwd(*a, **k):
        calls["fwd"] += 1
        return fwd(*a, **k)

    def counting_bwd(*a, **k):
        calls["bwd"] += 1
        return bwd(*a, **k)

    monkeypatch.setattr(logprobs_triton, "local_stats", counting_fwd)
    monkeypatch.setattr(logprobs_triton, "logits_grad", counting_bwd)

    logits, targets, w_logp, w_ent = make(n_tokens, vocab, vocab_size, dtype, seed=vocab)
    x = logits.clone().requires_grad_(True)
    poison_allocator(x.numel() * x.element_size())
    out = logprobs_from_logits(
        x,
        targets,
        temperature=temperature,
        vocab_size=vocab_size,
        with_entropy=entropy != "off",
        entropy_grad=entropy == "grad",
    )
    logp, ent = out if entropy != "off" else (out, None)
    use_ent = w_ent if entropy == "grad" else None
    ref_logp, ref_ent, ref_grad = logits_reference(
        logits, targets, temperature, vocab_size, w_logp, use_ent
    )
    assert rel_err(logp, ref_logp) < FWD_TOL
    if ent is not None:
        assert rel_err(ent, ref_ent) < FWD_TOL
        assert ent.requires_grad == (entropy == "grad")
    loss = (w_logp * logp).sum()
    if entropy == "grad":
        loss = loss + (w_ent * ent).sum()
    poison_allocator(x.numel() * x.element_size())
    loss.backward()
    assert x.grad.dtype == dtype
    assert torch.isfinite(x.grad).all()  # every element written, none from the NaN poison
    assert rel_err(x.grad, ref_grad) < GRAD_TOL[dtype]
    assert torch.all(x.grad[:, vocab_size:] == 0)
    assert calls == {"fwd": 1, "bwd": 1}  # the Triton kernels ran, not the PyTorch path


def test_torch_path_on_cuda_matches_fp64() -> None:
    logits, targets, w_logp, w_ent = make(33, 5003, 5000, torch.bfloat16, seed=1)
    x = logits.clone().requires_grad_(True)
    logp, ent = logprobs_from_logits(
        x, targets, temperature=0.9, vocab_size=5000, with_entropy=True, kernel="torch"
    )
    ref_logp, ref_ent, ref_grad = logits_reference(logits, targets, 0.9, 5000, w_logp, w_ent)
    assert rel_err(logp, ref_logp) < FWD_TOL and rel_err(ent, ref_ent) < FWD_TOL
    ((w_logp * logp).sum() + (w_ent * ent).sum()).backward()
    assert rel_err(x.grad, ref_grad) < GRAD_TOL[torch.bfloat16]


def test_row_strided_view_and_large_logits() -> None:
    # rows 4096 apart in memory, logits around 1e3 (exp would overflow without the max shift)
    base = torch.randn(19, 4096, device="cuda") * 5 + 1e3
    targets = torch.randint(0, 3001, (19,), device="cuda")
    x = base.clone().requires_grad_(True)
    logp, ent = logprobs_from_logits(x[:, :3001], targets, with_entropy=True)
    ref_logp, ref_ent, ref_grad = logits_reference(
        base[:, :3001], targets, 1.0, 3001, torch.ones(19, device="cuda"), None
    )
    torch.testing.assert_close(logp.double(), ref_logp, atol=5e-4, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=5e-3, rtol=0)
    logp.sum().backward()
    assert rel_err(x.grad[:, :3001], ref_grad) < 1e-4
    assert torch.all(x.grad[:, 3001:] == 0)


def test_zero_tokens_on_cuda() -> None:
    x = torch.zeros(0, 1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    logp, ent = logprobs_from_logits(
        x, torch.zeros(0, dtype=torch.long, device="cuda"), with_entropy=True
    )
    (logp.sum() + ent.sum()).backward()
    assert logp.shape == (0,) and x.grad.shape == (0, 1000)


def test_kernels_on_vocabulary_shards() -> None:
    """The kernels' local statistics and gradient for each shard of a TP = 3 split (the last
    shard partly padding), combined here by hand: max over shards, rescaled sums added."""
    from unirl.core.maths.kernels import logprobs_triton as k

    vocab_local, vocab_size, tp, tau = 20011, 57000, 3, 0.7
    logits, targets, w_logp, w_ent = make(29, vocab_local * tp, vocab_size, torch.bfloat16, 5)
    targets[1], targets[2] = vocab_local - 1, vocab_local  # on either side of a shard border
    ref_logp, ref_ent, ref_grad = logits_reference(logits, targets, tau, vocab_size, w_logp, w_ent)

    stats = []
    for r in range(tp):
        shard = logits[:, r * vocab_local : (r + 1) * vocab_local]  # a row-strided view
        n_valid = min(vocab_local, vocab_size - r * vocab_local)
        stats.append(
            k.local_stats(shard, targets, r * vocab_local, n_valid, 1 / tau, with_entropy=True)
        )
    # logsumexp over shards: M = max_r m_r, S = sum_r s_r exp(m_r - M), lse = M + log S
    big_m = torch.stack([s[0] for s in stats]).amax(0)
    scales = [torch.exp(s[0] - big_m) for s in stats]
    big_s = sum(s[1] * c for s, c in zip(stats, scales))
    sum_pz = sum(s[2] * c for s, c in zip(stats, scales))
    target_logit = sum(s[3] for s in stats)  # only the owning shard reads it
    lse = big_m + torch.log(big_s)
    mean_z = sum_pz / big_s
    assert rel_err(target_logit - lse, ref_logp) < FWD_TOL
    assert rel_err(lse - mean_z, ref_ent) < FWD_TOL
    for r in range(tp):
        cols = slice(r * vocab_local, (r + 1) * vocab_local)
        n_valid = min(vocab_local, vocab_size - r * vocab_local)
        grad = k.logits_grad(
            logits[:, cols], targets, r * vocab_local, n_valid, 1 / tau, lse, w_logp, mean_z, w_ent
        )
        assert rel_err(grad, ref_grad[:, cols]) < GRAD_TOL[torch.bfloat16], r
        if n_valid < vocab_local:
            assert torch.all(grad[:, n_valid:] == 0)


def test_rows_past_2_pow_31_elements() -> None:
    # 14,200 x 151,936 = 2.157e9 elements > 2**31: the last rows need 64-bit offsets
    n_tokens, vocab = 14200, 151936
    assert n_tokens * vocab > 2**31
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(n_tokens, vocab, device="cuda", generator=g, dtype=torch.bfloat16)
    x.requires_grad_(True)
    targets = torch.randint(0, vocab, (n_tokens,), device="cuda", generator=g)
    logp = logprobs_from_logits(x, targets)
    logp.sum().backward()
    rows = torch.tensor([0, 1, n_tokens // 2, n_tokens - 2, n_tokens - 1], device="cuda")
    ref_logp, _, ref_grad = logits_reference(
        x.detach()[rows], targets[rows], 1.0, vocab, torch.ones(len(rows), device="cuda"), None
    )
    assert rel_err(logp[rows], ref_logp) < FWD_TOL
    assert rel_err(x.grad[rows], ref_grad) < GRAD_TOL[torch.bfloat16]
    assert bool(torch.isfinite(x.grad).all())
