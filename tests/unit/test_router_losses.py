"""`unirl.core.maths.losses.router`: the load-balancing loss against Hugging Face's own
``load_balancing_loss_func`` (value and gradient), the z-loss against its formula written out,
a hand-computed case, and the microbatch weighting of the loss term and its metrics."""

import math

import pytest
import torch

from unirl.core.errors import LossInputError
from unirl.core.maths.losses.metrics import reduce_metrics
from unirl.core.maths.losses.router import (
    router_loss_shares,
    router_loss_term,
    router_losses,
    router_statistics,
)


def _layer_logits(layers: int, rows: int, experts: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        (2.0 * torch.randn(rows, experts, generator=g, dtype=torch.float32)).requires_grad_()
        for _ in range(layers)
    ]


def test_hand_computed_two_experts_top1():
    # probs [.75, .25] and [.25, .75]: each expert gets one of the two top-1 assignments
    # (f = [1/2, 1/2]) and a mean probability of 1/2: aux = 2 * (1/4 + 1/4) = 1.
    # logsumexp = log(3 + 1) for both rows: z = log(4)^2.
    logits = torch.tensor([[math.log(3.0), 0.0], [0.0, math.log(3.0)]])
    aux, z = router_losses([logits], top_k=1, num_experts=2)
    assert aux.item() == pytest.approx(1.0, abs=1e-6)
    assert z.item() == pytest.approx(math.log(4.0) ** 2, abs=1e-6)


@pytest.mark.parametrize(("layers", "top_k"), [(1, 1), (3, 2), (2, 4)])
def test_aux_equals_hugging_face_value_and_gradient(layers, top_k):
    hf = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    experts = 8
    ours_in = _layer_logits(layers, rows=13, experts=experts, seed=layers)
    ref_in = [t.detach().clone().requires_grad_() for t in ours_in]

    aux, _ = router_losses(ours_in, top_k=top_k, num_experts=experts)
    ref = hf.load_balancing_loss_func(tuple(ref_in), experts, top_k)
    torch.testing.assert_close(aux, ref, rtol=1e-6, atol=1e-7)

    weight = 0.37  # any scalar upstream gradient
    (weight * aux).backward()
    (weight * ref).backward()
    for ours, theirs in zip(ours_in, ref_in):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-8)


def test_real_rows_only_equals_hugging_face_with_its_attention_mask():
    hf = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    experts, top_k, batch, seq = 6, 2, 2, 5
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    logits = _layer_logits(2, rows=batch * seq, experts=experts, seed=7)
    keep = mask.reshape(-1).bool()
    aux, _ = router_losses([t[keep] for t in logits], top_k=top_k, num_experts=experts)
    ref = hf.load_balancing_loss_func(tuple(logits), experts, top_k, mask)
    torch.testing.assert_close(aux, ref, rtol=1e-6, atol=1e-7)


def test_z_loss_equals_its_formula_value_and_gradient():
    experts = 5
    ours_in = _layer_logits(3, rows=7, experts=experts, seed=3)
    ref_in = [t.detach().clone().double().requires_grad_() for t in ours_in]

    _, z = router_losses(ours_in, top_k=2, num_experts=experts)
    # mean over every row of every layer of (log sum_e exp l_e)^2
    squares = [torch.log(torch.exp(t).sum(dim=-1)) ** 2 for t in ref_in]
    ref = torch.cat(squares).sum() / sum(t.shape[0] for t in ref_in)
    torch.testing.assert_close(z.double(), ref, rtol=1e-6, atol=1e-8)

    z.backward()
    ref.backward()
    for ours, theirs in zip(ours_in, ref_in):
        torch.testing.assert_close(ours.grad.double(), theirs.grad, rtol=1e-5, atol=1e-8)


def test_logits_may_keep_their_batch_dims():
    flat = _layer_logits(2, rows=12, experts=4, seed=11)
    shaped = [t.detach().reshape(3, 4, 4) for t in flat]
    for a, b in zip(
        router_losses(flat, top_k=2, num_experts=4), router_losses(shaped, top_k=2, num_experts=4)
    ):
        torch.testing.assert_close(a, b)


def test_refuses_logits_that_do_not_fit():
    with pytest.raises(LossInputError, match="at least one MoE layer"):
        router_losses([], top_k=1, num_experts=2)
    with pytest.raises(LossInputError, match="top_k=3 must be between 1 and num_experts=2"):
        router_losses([torch.zeros(2, 2)], top_k=3, num_experts=2)
    with pytest.raises(LossInputError, match=r"MoE layer 1 have shape \(2, 3\)"):
        router_losses([torch.zeros(2, 4), torch.zeros(2, 3)], top_k=1, num_experts=4)


def test_loss_term_is_the_token_weighted_mean_over_microbatches_and_ranks():
    # Three forwards of one step (say two microbatches on rank 0, one on rank 1) with 3, 5 and
    # 4 routed tokens: N = 12. The terms must add up to coef * (3 a1 + 5 a2 + 4 a3) / 12.
    aux_coef, z_coef = 0.01, 0.001
    tokens = [3, 5, 4]
    forwards = [
        router_losses(_layer_logits(2, rows=n, experts=4, seed=20 + i), top_k=2, num_experts=4)
        for i, n in enumerate(tokens)
    ]
    outs = [
        router_loss_term(
            aux,
            z,
            aux_coef=aux_coef,
            z_coef=z_coef,
            microbatch_tokens=n,
            global_tokens=sum(tokens),
        )
        for (aux, z), n in zip(forwards, tokens)
    ]
    total = sum(o.loss for o in outs)
    aux_mean = sum(n * aux.item() for (aux, _), n in zip(forwards, tokens)) / 12
    z_mean = sum(n * z.item() for (_, z), n in zip(forwards, tokens)) / 12
    assert total.item() == pytest.approx(aux_coef * aux_mean + z_coef * z_mean, rel=1e-6)
    logged = reduce_metrics([o.metrics for o in outs])
    assert logged["router/aux_loss"] == pytest.approx(aux_mean, rel=1e-6)
    assert logged["router/z_loss"] == pytest.approx(z_mean, rel=1e-6)


def test_one_microbatch_is_the_hugging_face_term():
    hf = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    logits = _layer_logits(2, rows=9, experts=8, seed=5)
    aux, z = router_losses(logits, top_k=2, num_experts=8)
    out = router_loss_term(aux, z, aux_coef=0.001, z_coef=0.0, microbatch_tokens=9, global_tokens=9)
    ref = 0.001 * hf.load_balancing_loss_func(tuple(t.detach() for t in logits), 8, 2)
    torch.testing.assert_close(out.loss.detach(), ref, rtol=1e-6, atol=1e-9)


def test_loss_term_refuses_token_counts_that_do_not_fit():
    zero = torch.zeros(())
    with pytest.raises(LossInputError, match="microbatch_tokens=5 must be between 0 and"):
        router_loss_term(zero, zero, aux_coef=1, z_coef=1, microbatch_tokens=5, global_tokens=4)
    empty = router_loss_term(zero, zero, aux_coef=1, z_coef=1, microbatch_tokens=0, global_tokens=0)
    assert empty.loss.item() == 0.0


def test_a_forward_split_over_stages_and_cp_ranks_adds_up_to_the_pooled_value():
    # 3 MoE layers of 10 rows: pipeline stage 0 holds layers 0-1, stage 1 layer 2, and two
    # context-parallel ranks hold rows 0-3 and 4-9 of every layer: four parts.
    hf = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    experts, top_k, tokens = 6, 2, 10
    logits = _layer_logits(3, rows=tokens, experts=experts, seed=9)
    ref_in = [t.detach().clone().requires_grad_() for t in logits]
    parts = [
        [t[rows] for t in layers]
        for layers in (logits[:2], logits[2:])
        for rows in (slice(0, 4), slice(4, 10))
    ]
    stats = [router_statistics(p, top_k=top_k, num_experts=experts) for p in parts]
    # what the backend's all-reduce over the parts would sum (no gradient)
    assignments = sum(s.assignments_e for s in stats)
    rows = sum(s.rows for s in stats)
    shares = [router_loss_shares(s, assignments_e=assignments, rows=rows) for s in stats]
    aux = sum(a for a, _ in shares)
    z = sum(z for _, z in shares)

    ref = hf.load_balancing_loss_func(tuple(ref_in), experts, top_k)
    torch.testing.assert_close(aux, ref, rtol=1e-6, atol=1e-7)
    pooled_z = torch.cat([torch.logsumexp(t.detach(), -1) ** 2 for t in logits]).mean()
    torch.testing.assert_close(z, pooled_z, rtol=1e-6, atol=1e-7)
    aux.backward()
    ref.backward()
    for ours, theirs in zip(logits, ref_in):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-8)

    # each part's term: the whole microbatch's tokens, its share of the rows for the metric
    outs = [
        router_loss_term(
            a,
            zz,
            aux_coef=1.0,
            z_coef=0.0,
            microbatch_tokens=tokens,
            global_tokens=tokens,
            part=s.rows / rows,
        )
        for (a, zz), s in zip(shares, stats)
    ]
    assert sum(o.loss for o in outs).item() == pytest.approx(ref.item(), rel=1e-6)
    logged = reduce_metrics([o.metrics for o in outs])
    assert logged["router/aux_loss"] == pytest.approx(ref.item(), rel=1e-6)
    assert logged["router/z_loss"] == pytest.approx(pooled_z.item(), rel=1e-6)
