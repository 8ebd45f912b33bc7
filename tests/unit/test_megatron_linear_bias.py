"""`unirl.backends.megatron.kernels.linear_bias`: megatron's linear layers with the bias added in the
matmul's epilogue. On the CPU (the classes run anywhere; gpu_fusions installs them on CUDA only):
the forward against a float64 reference, megatron's backward through the new forward giving
megatron's gradients, and the calls it hands back to megatron."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install unirl[megatron])")

from unirl.backends.megatron.kernels import linear_bias

TRAINABLE = (False, False, False, None, 0, None)  # no fusion, no TP all-reduce, no SP, no buffer


def _inputs(dtype, seed=0, bias=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 3, 24, generator=gen).to(dtype)
    w = (0.3 * torch.randn(20, 24, generator=gen)).to(dtype)
    b = torch.randn(20, generator=gen).to(dtype) if bias else None
    dy = torch.randn(5, 3, 20, generator=gen).to(dtype)
    return x, w, b, dy


def _run(cls, x, w, b, dy, extra, n_grads):
    leaves = [t.clone().requires_grad_() for t in (x, w, b) if t is not None]
    y = cls.apply(leaves[0], leaves[1], leaves[2] if b is not None else None, *extra)
    grads = torch.autograd.grad(y, leaves[:n_grads], dy)
    return y.detach(), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_matches_float64_and_backward_is_megatrons(dtype):
    x, w, b, dy = _inputs(dtype)
    exact = x.double() @ w.double().T + b.double()
    want, want_grads = _run(linear_bias.ORIGINAL, x, w, b, dy, TRAINABLE, 3)
    got, got_grads = _run(linear_bias.LinearWithBiasEpilogue, x, w, b, dy, TRAINABLE, 3)
    assert got.shape == want.shape == (5, 3, 20) and got.dtype == dtype
    # one rounding of the fp32 accumulator (+ bias) where megatron rounds the product and the sum
    unit = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-23
    scale = float(exact.abs().max())
    assert float((got.double() - exact).abs().max()) <= 2 * unit * scale
    assert (
        float((got.double() - exact).abs().max())
        <= float((want.double() - exact).abs().max()) + unit * scale
    )
    # the bias gradient is the sum of dy over tokens; input and weight gradients dy @ W, dy^T x
    for a, c in zip(want_grads, got_grads):
        assert torch.equal(a, c)
    torch.testing.assert_close(
        got_grads[2].double(), dy.double().sum(dim=(0, 1)), rtol=1e-2, atol=1e-2
    )


def test_frozen_forward_and_input_gradient():
    x, w, b, dy = _inputs(torch.float32, seed=1)
    got, (gx,) = _run(linear_bias.FrozenLinearWithBiasEpilogue, x, w, b, dy, (False, None), 1)
    want, (wx,) = _run(linear_bias.ORIGINAL_FROZEN, x, w, b, dy, (False, None), 1)
    torch.testing.assert_close(
        got.double(), x.double() @ w.double().T + b.double(), rtol=1e-6, atol=1e-6
    )
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(gx, wx)
    torch.testing.assert_close(gx.double(), dy.double() @ w.double(), rtol=1e-6, atol=1e-6)


def test_calls_it_does_not_cover_are_megatrons_own():
    """No bias, or sequence parallel (the input all-gathered inside): megatron's forward, bit for
    bit (the sequence-parallel call is refused as megatron refuses it without a TP group)."""
    x, w, _, dy = _inputs(torch.float32, seed=2, bias=False)
    want, want_grads = _run(linear_bias.ORIGINAL, x, w, None, dy, TRAINABLE, 2)
    got, got_grads = _run(linear_bias.LinearWithBiasEpilogue, x, w, None, dy, TRAINABLE, 2)
    assert torch.equal(got, want) and all(map(torch.equal, want_grads, got_grads))
    x, w, b, _ = _inputs(torch.float32, seed=3)
    sp = (False, False, True, None, 0, None)
    with pytest.raises(Exception) as theirs:
        linear_bias.ORIGINAL.apply(x, w, b, *sp)
    with pytest.raises(type(theirs.value)):
        linear_bias.LinearWithBiasEpilogue.apply(x, w, b, *sp)
