"""`fuse_adam`: megatron's torch AdamW switched to torch's fused kernel still takes AdamW's steps
(against the update written out by hand in float64), keeps its counts where the kernel reads
them, and leaves an optimizer that is not torch's alone."""

from __future__ import annotations

import math
import types

import pytest
import torch

pytest.importorskip("megatron.core")

from unirl.backends.megatron.optimizer import adam_step, fuse_adam


def _megatron_like(inner: torch.optim.Optimizer) -> types.SimpleNamespace:
    return types.SimpleNamespace(optimizer=inner)  # megatron's wrappers hold it as .optimizer


def _adamw_by_hand(w, grads, lr, betas, eps, wd):
    w = w.double().clone()
    m = torch.zeros_like(w)
    v = torch.zeros_like(w)
    b1, b2 = betas
    for t, g in enumerate(grads, start=1):
        g = g.double()
        w = w * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat = m / (1 - b1**t)
        v_hat = v / (1 - b2**t)
        w = w - lr * m_hat / (v_hat.sqrt() + eps)
    return w


def test_fused_adamw_takes_adamws_steps():
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(37, 5, generator=g)
    grads = [torch.randn(37, 5, generator=g) for _ in range(4)]
    param = torch.nn.Parameter(w0.clone())
    inner = torch.optim.AdamW([param], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    reason = fuse_adam(_megatron_like(inner))
    assert "fused kernel (1 parameter group" in reason
    assert inner.param_groups[0]["fused"] is True and inner.param_groups[0]["foreach"] is False
    for grad in grads:
        param.grad = grad.clone()
        inner.step()
    want = _adamw_by_hand(w0, grads, 1e-2, (0.9, 0.95), 1e-8, 0.1)
    torch.testing.assert_close(param.detach().double(), want, rtol=1e-5, atol=1e-6)
    assert float(inner.state[param]["step"]) == 4.0
    assert inner.state[param]["step"].dtype == torch.float32


def test_existing_counts_move_to_where_the_kernel_reads_them_and_repeat_is_harmless():
    param = torch.nn.Parameter(torch.ones(3))
    inner = torch.optim.AdamW([param], lr=0.1)
    param.grad = torch.ones(3)
    inner.step()  # foreach: the count is a CPU scalar (float32 by default dtype)
    inner.state[param]["step"] = torch.tensor(1.0, dtype=torch.float64)
    fuse_adam(_megatron_like(inner))
    fuse_adam(_megatron_like(inner))
    step = inner.state[param]["step"]
    assert step.dtype == torch.float32 and step.device == param.device and float(step) == 1.0
    param.grad = torch.ones(3)
    inner.step()
    assert float(inner.state[param]["step"]) == 2.0


def test_adam_step_follows_torchs_rule():
    p = torch.zeros(2)
    assert adam_step(3, {"fused": True}, p).dtype == torch.float32
    assert adam_step(3, {"fused": False, "capturable": False}, p).device.type == "cpu"
    assert math.isclose(float(adam_step(3, {}, p)), 3.0)


def test_an_optimizer_that_is_not_torchs_adam_is_left_alone():
    param = torch.nn.Parameter(torch.ones(3))
    inner = torch.optim.SGD([param], lr=0.1)
    before = dict(inner.param_groups[0])
    reason = fuse_adam(_megatron_like(inner))
    assert "SGD" in reason
    assert {k: v for k, v in inner.param_groups[0].items() if k != "params"} == {
        k: v for k, v in before.items() if k != "params"
    }


def test_chained_optimizers_are_each_fused():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    chained = types.SimpleNamespace(
        chained_optimizers=[_megatron_like(torch.optim.AdamW([p], lr=0.1)) for p in (a, b)]
    )
    assert "fused kernel" in fuse_adam(chained)
    assert all(o.optimizer.param_groups[0]["fused"] for o in chained.chained_optimizers)
