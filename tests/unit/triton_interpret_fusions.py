"""Run by `test_megatron_gpu_fusions.test_kernels_in_the_triton_interpreter` with
``TRITON_INTERPRET=1`` (set before Triton decorates the kernels): the RoPE, SwiGLU and RMSNorm
kernels on CPU tensors against megatron-core's own functions or float64. Prints one line per check; exits non-zero on
the first mismatch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings import rope_utils

from unirl.backends.megatron.kernels import fused_rmsnorm, fused_rope, fused_swiglu
from unirl.backends.megatron.kernels.gpu_fusions import CPGroupShape as Group


def rope_checks() -> None:
    gen = torch.Generator().manual_seed(0)
    dim = 16
    inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(64, dtype=torch.float32), inv)
    freqs = torch.cat((angles, angles), dim=-1)[:, None, None, :]
    for dtype in (torch.float32, torch.bfloat16):
        for cp, rank in ((1, 0), (2, 1)):
            cu = torch.tensor([0, 8, 20, 36, 40], dtype=torch.int32)
            tokens = int(cu[-1]) // cp
            # k as megatron splits it: a strided view of a wider tensor
            wide = torch.randn(tokens, 3, 2 * dim, generator=gen).to(dtype)
            grad = torch.randn(tokens, 3, dim, generator=gen).to(dtype)
            outs = []
            for fused in (False, True):
                base = wide.clone().requires_grad_()
                t = base[..., :dim]
                if fused:
                    rows = fused_rope.thd_freq_rows(
                        cu.tolist(), cp_size=cp, cp_rank=rank, offsets=False
                    )
                    cos, sin = fused_rope.rope_tables(freqs, rows, dtype, 1.0)
                    out = fused_rope.PackedRope.apply(t, cos, sin)
                else:
                    out = rope_utils._apply_rotary_pos_emb_thd(
                        t, cu, freqs, cp_group=Group(cp, rank)
                    )
                outs.append((out, torch.autograd.grad(out, base, grad)[0]))
            (want, want_grad), (got, got_grad) = outs
            assert torch.equal(got, want), (dtype, cp, (got - want).abs().max())
            assert torch.equal(got_grad, want_grad), (dtype, cp)
            print(f"rope {dtype} cp={cp}: identical forward and gradient")


def swiglu_checks() -> None:
    gen = torch.Generator().manual_seed(1)
    rows, width = 7, 1100  # two column blocks, the second partly masked
    y = 3 * torch.randn(rows, 2 * width, generator=gen)
    g = torch.randn(rows, width, generator=gen)
    out = torch.empty(rows, 2 * width)
    grid = (rows, -(-width // fused_swiglu.BLOCK))
    fused_swiglu._swiglu_back_kernel[grid](
        g, y, out, width, g.stride(0), y.stride(0), BLOCK_F=fused_swiglu.BLOCK
    )
    y64 = y.double().requires_grad_()
    y1, y2 = y64.chunk(2, dim=-1)
    (want,) = torch.autograd.grad(F.silu(y1) * y2, y64, g.double())
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    print("swiglu_back fp32: matches float64 autograd")


def rmsnorm_checks() -> None:
    """Forward and both gradients against float64 autograd: rows not a multiple of the row block,
    a width below its power of two (masked columns), more row blocks than programs (the
    backward's loop and its weight-gradient partials)."""
    fused_rmsnorm._programs = lambda device: 3  # the CUDA SM count, absent here
    gen = torch.Generator().manual_seed(2)
    for rows, width, dtype in (
        (37, 40, torch.float32),
        (50, 128, torch.bfloat16),
        (5, 16, torch.float32),
    ):
        x = (2 * torch.randn(rows, 1, width, generator=gen)).to(dtype)
        w = (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype)
        dy = torch.randn(rows, 1, width, generator=gen).to(dtype)
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fused_rmsnorm.rms_norm(xx, ww, 1e-5)
        gx, gw = torch.autograd.grad(y, (xx, ww), dy)
        x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
        y64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w64
        gx64, gw64 = torch.autograd.grad(y64, (x64, w64), dy.double())
        # fp32: a few ulps (summation order); bf16: one rounding of each stored value
        tol = 1e-5 if dtype == torch.float32 else 2.0**-7
        for got, want in ((y, y64), (gx, gx64), (gw, gw64)):
            assert got.shape == want.shape and got.dtype == dtype
            err = (got.double() - want).abs().max() / want.abs().max()
            assert err <= tol, (rows, width, dtype, float(err))
        print(f"rmsnorm {rows}x{width} {dtype}: matches float64 autograd")


def probe_checks() -> None:
    """The install probe's own code at a model's shapes (head dims, GQA head counts, bf16 and
    fp32), under no_grad as a model may be built; the interpreter runs on CPU tensors, so the
    kernels' CUDA-only refusal is lifted for it here."""
    import importlib

    from unirl.backends.megatron.kernels import gpu_fusions

    fused_rope.fused_path_refusal = lambda *args: None
    fused_rmsnorm.fused_path_refusal = lambda *args: None
    for patch in gpu_fusions.PATCHES:
        module = importlib.import_module(patch.module)
        patch.originals.setdefault(patch.name, getattr(module, patch.name))
    shapes = [
        gpu_fusions.ProbeShape(32, (2, 6), torch.bfloat16),
        gpu_fusions.ProbeShape(16, (3,), torch.float32),
    ]
    for shape in shapes:
        with torch.no_grad():
            why = gpu_fusions.probe(torch.device("cpu"), shape)
        assert why is None, (shape, why)
        print(f"probe {shape.head_dim} {shape.heads} {shape.dtype}: passes")
    # with the patches on (a later model's probe), megatron's side is still megatron's: a
    # wrong kernel installed in its place is caught
    from megatron.core.models.common.embeddings import rope_utils

    wrong = lambda t, *args, **kwargs: t * 2  # noqa: E731
    rope_utils._apply_rotary_pos_emb_thd = wrong
    fused_rope.apply_rotary_pos_emb_thd = wrong
    why = gpu_fusions.probe(torch.device("cpu"), shapes[0])
    assert why is not None and "differs" in why, why
    print("probe with a wrong kernel installed: refuses")


if __name__ == "__main__":
    rope_checks()
    swiglu_checks()
    rmsnorm_checks()
    probe_checks()
