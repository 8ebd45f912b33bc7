"""The router's auxiliary losses under context parallelism (Ulysses on FSDP2: the router sees the
rank's CP-local tokens, CP padding included), on gloo with CP = 2: the ranks' shares of
`unirl.core.moe_loss.router_term` add up to the unsplit forward's term, its gradients too, and the
reduced ``router/aux_loss`` / ``router/z_loss`` metrics are the unsplit values. The reference is
transformers' ``load_balancing_loss_func`` and a hand-written z-loss over the unsplit rows."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist

from tests.spawn import run_distributed
from unirl.core.data.context_parallel import CPLayout
from unirl.core.data.microbatch import TrainMicrobatch
from unirl.core.data.routed_experts import MoeShape
from unirl.core.maths.losses import reduce_metrics
from unirl.core.maths.losses.router import RouterCoefficients
from unirl.core.moe_loss import RouterLossSettings, router_term

EXPERTS, TOP_K, LAYERS, VOCAB, MAX_POS = 6, 2, 2, 9, 16
LENGTHS = [7, 2, 5]  # 2 tokens: shorter than 2*cp, so a rank holds padding only of it
AUX, Z = 0.7, 0.2
EXTRA = 5  # tokens of the step's other microbatches / ranks
SETTINGS = RouterLossSettings(
    shape=MoeShape(num_experts=EXPERTS, top_k=TOP_K, moe_layers=(0, 1), norm_topk_prob=True),
    router_coefficients=RouterCoefficients(aux_coef=AUX, z_coef=Z),
)


def batch() -> dict:
    g = torch.Generator().manual_seed(7)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    return {
        "cu": cu,
        "tokens": torch.randint(0, VOCAB, (int(cu[-1]),), generator=g),
        "w": torch.randn(LAYERS, VOCAB, EXPERTS, generator=g, dtype=torch.float32),
        "p": torch.randn(LAYERS, MAX_POS, EXPERTS, generator=g, dtype=torch.float32),
    }


def router_logits(w, p, tokens, positions):
    """A toy router: per layer, logits from the token and its global position."""
    return [w[layer][tokens] + p[layer][positions] for layer in range(LAYERS)]


def _worker(rank: int, world_size: int) -> bytes:
    group = dist.new_group(list(range(world_size)))
    b = batch()
    lay = CPLayout.build(b["cu"], world_size, rank)
    tokens = lay.split(b["tokens"])
    n = tokens.numel()
    mb = TrainMicrobatch(
        sample_indices=tuple(range(len(LENGTHS))),
        tokens=tokens,
        position_ids=lay.position_ids,
        cu_seqlens=lay.local_cu_seqlens.to(torch.int32),
        targets=torch.zeros(n, dtype=torch.long),
        loss_mask=torch.zeros(n),
        seq_ids=lay.seq_ids,
        seq_token_counts=torch.zeros(len(LENGTHS), dtype=torch.long),
        cp_group=group,
        global_cu_seqlens=b["cu"],
    )
    w = b["w"].clone().requires_grad_()
    p = b["p"].clone().requires_grad_()
    total = int(b["cu"][-1]) + EXTRA
    out = router_term(
        router_logits(w, p, tokens, lay.position_ids), mb, SETTINGS, global_tokens=total
    )
    out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=group)
    dist.all_reduce(w.grad, group=group)
    dist.all_reduce(p.grad, group=group)
    metrics = reduce_metrics([out.metrics], group=group)
    buf = io.BytesIO()
    torch.save({"loss": loss, "w": w.grad, "p": p.grad, "metrics": metrics}, buf)
    return buf.getvalue()


def reference() -> dict:
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    del transformers
    b = batch()
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    w = b["w"].clone().requires_grad_()
    p = b["p"].clone().requires_grad_()
    logits = router_logits(w, p, b["tokens"], positions)
    aux = load_balancing_loss_func(tuple(logits), EXPERTS, TOP_K)
    z = (torch.logsumexp(torch.cat(logits), -1) ** 2).mean()
    n = int(b["cu"][-1])
    loss = (AUX * aux + Z * z) * n / (n + EXTRA)
    loss.backward()
    return {
        "loss": loss.detach(),
        "w": w.grad,
        "p": p.grad,
        "aux": float(aux.detach()),
        "z": float(z.detach()),
    }


def test_router_term_under_cp2_equals_the_unsplit_forward():
    ref = reference()
    results = [torch.load(io.BytesIO(r)) for r in run_distributed(_worker, 2)]
    for got in results:
        torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["w"], ref["w"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["p"], ref["p"], rtol=1e-5, atol=1e-6)
        assert got["metrics"]["router/aux_loss"] == pytest.approx(ref["aux"], rel=1e-5)
        assert got["metrics"]["router/z_loss"] == pytest.approx(ref["z"], rel=1e-5)
