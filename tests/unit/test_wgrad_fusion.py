"""Megatron's gradient-accumulation fusion without Apex (`unirl.backends.megatron.kernels.wgrad_fusion`):
the fused accumulation against a float64 reference on a GPU, and the CPU left on the unfused
path with megatron-core untouched."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install unirl[megatron])")

from unirl.backends.megatron.kernels import wgrad_fusion


def test_cpu_keeps_megatron_unfused(monkeypatch):
    from megatron.core.tensor_parallel import layers

    monkeypatch.setitem(wgrad_fusion._state, "installed", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    before = layers._grad_accum_fusion_available
    assert wgrad_fusion.install() is before
    assert layers._grad_accum_fusion_available is before
    assert getattr(layers, "fused_weight_gradient_mlp_cuda", None) is not wgrad_fusion.EXTENSION


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: addmm with out_dtype")
def test_fused_accumulation_on_cuda_matches_float64():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4096, 512, generator=gen).cuda().bfloat16()
    g = torch.randn(4096, 768, generator=gen).cuda().bfloat16()
    acc0 = torch.randn(768, 512, generator=gen).cuda()
    acc = acc0.clone()
    wgrad_fusion.wgrad_gemm_accum_fp32(x, g, acc)
    want = acc0.double() + g.double().t() @ x.double()
    # fp32 accumulation of exact bf16 products over 4096 rows: about 1e-5 of the result's scale,
    # where one bf16 rounding of the product alone is 4e-3 of it
    assert (acc.double() - want).abs().max().item() < 1e-4 * want.abs().max().item()
    unfused = acc0 + (g.t() @ x).float()  # bf16 product rounded before the add
    assert (acc.double() - want).abs().max() <= (unfused.double() - want).abs().max()
    assert wgrad_fusion.probe(torch.device("cuda")) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp32_model_accumulates_in_place():
    gen = torch.Generator().manual_seed(4)
    x, g = torch.randn(300, 40, generator=gen).cuda(), torch.randn(300, 24, generator=gen).cuda()
    acc0 = torch.randn(24, 40, generator=gen).cuda()
    acc = acc0.clone()
    wgrad_fusion.wgrad_gemm_accum_fp32(x, g, acc)
    want = acc0.double() + g.double().t() @ x.double()
    assert (acc.double() - want).abs().max().item() < 1e-4
