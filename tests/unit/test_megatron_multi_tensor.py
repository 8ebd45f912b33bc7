"""`unirl.backends.megatron.kernels.multi_tensor`: the gradient norm and clipping megatron-core runs
without TE / Apex, against the norm of all values at once in fp64 written here; `install`
leaves the CPU to `cpu_compat`. The CUDA install (megatron's own `get_grad_norm_fp32` then):
the `gpu` test."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core (pip install unirl[megatron])",
)


def _grads(device: str = "cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 5), (7,), (1,), (4, 2, 3)] + [(2, 2)] * 300  # more tensors than one launch
    return [torch.randn(s, generator=g).to(device) for s in shapes]


def _reference_norm(grads: list[torch.Tensor]) -> float:
    return float(torch.cat([t.double().reshape(-1).cpu() for t in grads]).square().sum().sqrt())


def test_l2_norm_is_the_norm_of_all_values_and_scale_multiplies():
    from unirl.backends.megatron.kernels.multi_tensor import foreach_l2_norm, foreach_scale

    grads = _grads()
    flag = torch.zeros(1, dtype=torch.int)
    norm, per_tensor = foreach_l2_norm(2048 * 32, flag, [grads], False)
    assert per_tensor is None and norm.shape == (1,) and norm.dtype == torch.float32
    assert norm.item() == pytest.approx(_reference_norm(grads), rel=1e-6)
    want = [t.double() * 0.25 for t in grads]
    foreach_scale(2048 * 32, flag, [grads, grads], 0.25)  # in place, as megatron clips
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=0)
    dst = [torch.empty_like(t) for t in grads]
    foreach_scale(2048 * 32, flag, [grads, dst], 2.0)
    for got, src in zip(dst, grads):
        torch.testing.assert_close(got, src * 2.0, rtol=0, atol=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case")
def test_install_leaves_the_cpu_to_cpu_compat():
    from megatron.core.optimizer import clip_grads

    from unirl.backends.megatron.kernels import multi_tensor

    before = clip_grads.l2_norm_impl
    assert multi_tensor.install() is False
    assert clip_grads.l2_norm_impl is before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_megatron_grad_norm_on_cuda_after_install():
    from megatron.core.optimizer import clip_grads

    from unirl.backends.megatron.kernels import multi_tensor

    multi_tensor.install()
    assert clip_grads.l2_norm_impl is multi_tensor.foreach_l2_norm
    grads = _grads("cuda")
    norm, _ = clip_grads.multi_tensor_applier(
        clip_grads.l2_norm_impl, torch.zeros(1, dtype=torch.int, device="cuda"), [grads], False
    )
    assert norm.is_cuda and norm.item() == pytest.approx(_reference_norm(grads), rel=1e-5)
