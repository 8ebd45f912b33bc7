"""Context-parallel packed attention on gloo: CP=2 and CP=4 give the output and the q/k/v
gradients of CP=1.

One packed stream of four sequences: 9 tokens, a single token, 3 tokens (shorter than ``2*cp``)
and 6 tokens, GQA 4 query heads over 2 key/value heads, fp64. Every rank builds the same global
q/k/v and upstream gradient, splits them with `CPLayout`, runs `cp_packed_causal_attention` on its
local part and backward from ``sum(out_local * grad_local)``. The parent merges the ranks' pieces
back to the global order and compares with the unsplit `packed_causal_attention` and with an
explicit fp64 softmax per sequence written here. Both kernels are exercised: the SDPA path with
a global-position mask, and the flash path's segment bookkeeping with a bottom-right-causal CPU
kernel standing in for flash (the real kernel needs CUDA).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from tests.spawn import run_distributed
from tests.unit.test_varlen_attention import bottom_right_causal_kernel
from unirl.backends.megatron.kernels import varlen_attention as va
from unirl.core.data.context_parallel import CPLayout, merge_cp_pieces

LENGTHS = [9, 1, 3, 6]
HQ, HKV, D = 4, 2, 8


def global_inputs():
    g = torch.Generator().manual_seed(7)
    total = sum(LENGTHS)
    q = torch.randn(total, HQ, D, generator=g, dtype=torch.float64)
    k = torch.randn(total, HKV, D, generator=g, dtype=torch.float64)
    v = torch.randn(total, HKV, D, generator=g, dtype=torch.float64)
    grad_out = torch.randn(total, HQ, D, generator=g, dtype=torch.float64)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    return q, k, v, grad_out, cu


def reference(q, k, v):
    """softmax(Q K^T / sqrt(D) + causal mask) V per sequence, fp64; kv head = h // 2."""
    outs, start = [], 0
    for n in LENGTHS:
        heads = []
        for h in range(HQ):
            qs = q[start : start + n, h]
            ks, vs = k[start : start + n, h // 2], v[start : start + n, h // 2]
            s = qs @ ks.T / math.sqrt(D)
            s = s.masked_fill(torch.arange(n)[None, :] > torch.arange(n)[:, None], float("-inf"))
            heads.append(torch.softmax(s, dim=-1) @ vs)
        outs.append(torch.stack(heads, dim=1))
        start += n
    return torch.cat(outs)


def cp_worker(rank: int, world_size: int) -> dict:
    q, k, v, grad_out, cu = global_inputs()
    layout = CPLayout.build(cu, world_size, rank)
    group = dist.group.WORLD
    results = {}
    for kernel in ("sdpa", "varlen"):
        if kernel == "varlen":
            va.varlen_available = lambda t: True
            va._varlen_kernel = bottom_right_causal_kernel
        ql, kl, vl = (layout.split(t).detach().requires_grad_() for t in (q, k, v))
        out = va.cp_packed_causal_attention(ql, kl, vl, layout, group)
        (out * layout.split(grad_out)).sum().backward()  # padded positions: upstream grad 0
        results[kernel] = [out.detach(), ql.grad, kl.grad, vl.grad]
    return results


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_matches_unsplit(cp):
    q, k, v, grad_out, cu = global_inputs()
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = reference(qr, kr, vr)
    ref.backward(grad_out)
    q1, k1, v1 = (t.clone().requires_grad_() for t in (q, k, v))
    out1 = va.packed_causal_attention(q1, k1, v1, cu)
    out1.backward(grad_out)
    torch.testing.assert_close(out1.detach(), ref.detach(), rtol=1e-10, atol=1e-10)

    per_rank = run_distributed(cp_worker, cp)
    for kernel in ("sdpa", "varlen"):
        merged = [merge_cp_pieces([r[kernel][i] for r in per_rank], cu) for i in range(4)]
        torch.testing.assert_close(merged[0], ref.detach(), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(merged[0], out1.detach(), rtol=1e-10, atol=1e-10)
        for got, cp1, fp64 in zip(merged[1:], (q1, k1, v1), (qr, kr, vr)):
            torch.testing.assert_close(got, cp1.grad, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(got, fp64.grad, rtol=1e-10, atol=1e-10)
