"""Ulysses attention on 2 gloo ranks against plain causal attention of each whole sequence: the
output of every local token and the gradients of the local queries, keys and values equal those of
the single-process computation (the all-to-alls and the reordering are exact permutations, and
their backward is the inverse exchange). Grouped-query attention with key/value heads that divide
the SP degree (4 query / 2 kv heads) and that do not (4 / 1: repeated before the exchange)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from tests.spawn import run_distributed

LENGTHS = (5, 8, 3, 1)  # padded to multiples of 4 for sp = 2; a one-token sequence
D = 8
SCALE = 0.3


def _reference(q, k, v):
    """Causal attention per sequence, written out: [H, T, D] -> [T, H, D]."""
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    outs, start = [], 0
    for n in LENGTHS:
        s = slice(start, start + n)
        outs.append(
            F.scaled_dot_product_attention(q[:, s], k[:, s], v[:, s], is_causal=True, scale=SCALE)
        )
        start += n
    return torch.cat(outs, 1).transpose(0, 1)


CASES = ((4, 2), (4, 1))  # (query heads, key/value heads)


def _worker(rank: int, world_size: int) -> dict:
    return {case: _one(rank, world_size, *case) for case in CASES}


def _one(rank: int, world_size: int, heads: int, kv_heads: int) -> dict:
    import torch.distributed as dist

    from unirl.backends.fsdp2.ulysses import PLAN_KWARG, UlyssesPlan, ulysses_attention
    from unirl.core.data.context_parallel import CPLayout

    g = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    q, k, v = (torch.randn(h, total, D, generator=g) for h in (heads, kv_heads, kv_heads))
    upstream = torch.randn(total, heads, D, generator=g)  # d loss / d output
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(LENGTHS), 0).tolist()])
    lay = CPLayout.build(cu, world_size, rank)

    def local(x):  # [H, T, D] -> this rank's tokens [1, H, T_local, D], a leaf
        return lay.split(x.transpose(0, 1)).transpose(0, 1)[None].clone().requires_grad_(True)

    ql, kl, vl = local(q), local(k), local(v)
    plan = UlyssesPlan.build(lay.local_cu_seqlens, dist.group.WORLD, torch.device("cpu"))

    class Layer:  # what transformers passes as `module`
        training = True

    out, _ = ulysses_attention(Layer(), ql, kl, vl, None, SCALE, 0.0, **{PLAN_KWARG: plan})
    (out[0] * lay.split(upstream)).sum().backward()
    real = lay.split(torch.ones(total)).bool()  # padding positions hold no real token
    return {
        "out": out[0].detach()[real],
        "grads": [x.grad[0].transpose(0, 1)[real] for x in (ql, kl, vl)],
        "real_index": lay.local_indices[real],
        "padded_positions": lay.padded_positions,
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(_worker, 2)  # one spawn for every case


@pytest.mark.parametrize(("heads", "kv_heads"), CASES)
def test_ulysses_equals_whole_sequence_attention(ranks, heads, kv_heads):
    results = [r[(heads, kv_heads)] for r in ranks]
    g = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    q, k, v = (
        torch.randn(h, total, D, generator=g).requires_grad_(True)
        for h in (heads, kv_heads, kv_heads)
    )
    upstream = torch.randn(total, heads, D, generator=g)
    out = _reference(q, k, v)
    (out * upstream).sum().backward()
    for rank, res in enumerate(results):
        # padded index -> global token index
        to_token = torch.full((int(res["padded_positions"].max()) + 8,), -1)
        to_token[res["padded_positions"]] = torch.arange(total)
        tokens = to_token[res["real_index"]]
        torch.testing.assert_close(
            res["out"], out.detach()[tokens], atol=1e-6, rtol=1e-5, msg=f"rank {rank}"
        )
        for name, got, ref in zip("qkv", res["grads"], (q.grad, k.grad, v.grad)):
            torch.testing.assert_close(
                got, ref.transpose(0, 1)[tokens], atol=1e-6, rtol=1e-5, msg=f"rank {rank} d{name}"
            )
