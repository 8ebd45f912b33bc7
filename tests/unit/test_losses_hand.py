"""Every policy loss, aggregation mode, rollout-correction mode and the value loss on small cases
worked out by hand (NeMo-RL style): the arithmetic is in the comments, the numbers in the test."""

from __future__ import annotations

import math

import pytest
import torch

from unirl.core.data.counts import GlobalCounts
from unirl.core.maths.losses import (
    LossInputs,
    LossSettings,
    aggregate,
    compute_loss,
    reduce_metrics,
    value_loss,
)

F64 = torch.float64


def _inputs(logp, old=None, adv=None, mask=None, lengths=None, **extra) -> LossInputs:
    """One microbatch; ``lengths`` splits the tokens into sequences (default: one sequence)."""
    logp = torch.tensor(logp, dtype=F64, requires_grad=True)
    n = logp.numel()
    lengths = lengths or [n]
    mask_t = (
        torch.ones(n, dtype=torch.bool) if mask is None else torch.tensor(mask, dtype=torch.bool)
    )
    seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    seq_counts = torch.zeros(len(lengths), dtype=torch.long).index_add(0, seq_ids, mask_t.long())
    return LossInputs(
        logprobs=logp,
        old_logprobs=None if old is None else torch.tensor(old, dtype=F64),
        advantages=torch.tensor(adv if adv is not None else [0.0] * n, dtype=F64),
        loss_mask=mask_t,
        seq_ids=seq_ids,
        num_seqs=len(lengths),
        seq_token_counts=seq_counts,
        **{k: torch.tensor(v, dtype=F64) for k, v in extra.items()},
    )


def _old_for_ratios(logp, ratios):
    # old = logp - log(r)  =>  exp(logp - old) = r
    return [lp - math.log(r) for lp, r in zip(logp, ratios)]


def _run(inp, counts, **settings):
    out = compute_loss(inp, counts, LossSettings(**settings))
    (grad,) = torch.autograd.grad(out.loss, inp.logprobs)
    return out.loss.item(), grad.tolist(), reduce_metrics([out.metrics])


LOGP = [-1.0, -2.0, -0.5]
RATIOS = [0.5, 1.0, 1.5]


def test_ppo_clip_positive_advantage():
    inp = _inputs(LOGP, _old_for_ratios(LOGP, RATIOS), adv=[1.0, 1.0, 1.0])
    loss, grad, m = _run(inp, GlobalCounts(tokens=3, sequences=1))
    # A = +1, clip [0.8, 1.2]; per token -min(r A, clip(r) A):
    #   r=0.5: -min(0.5, 0.8) = -0.5  (unclipped, d/dlogp = -r/3 = -0.5/3)
    #   r=1.0: -min(1.0, 1.0) = -1.0  (unclipped, d/dlogp = -1/3)
    #   r=1.5: -min(1.5, 1.2) = -1.2  (clipped, no gradient)
    # token-mean: (-0.5 - 1.0 - 1.2) / 3 = -0.9; clipfrac 1/3
    assert loss == pytest.approx(-0.9)
    assert grad == pytest.approx([-0.5 / 3, -1.0 / 3, 0.0])
    assert m["pg_clipfrac"] == pytest.approx(1 / 3)
    assert m["pg_loss"] == pytest.approx(-0.9)
    # ppo_kl = mean(old - new) = mean(-log r) = -(log 0.5 + 0 + log 1.5) / 3
    assert m["ppo_kl"] == pytest.approx(-(math.log(0.5) + math.log(1.5)) / 3)


def test_ppo_clip_negative_advantage():
    inp = _inputs(LOGP, _old_for_ratios(LOGP, RATIOS), adv=[-1.0, -1.0, -1.0])
    loss, grad, m = _run(inp, GlobalCounts(tokens=3, sequences=1))
    # A = -1: -min(-r, -clip(r)) = max(r, clip(r)):
    #   r=0.5: max(0.5, 0.8) = 0.8  (clipped)
    #   r=1.0: 1.0                  (d/dlogp = r/3 = 1/3)
    #   r=1.5: max(1.5, 1.2) = 1.5  (unclipped, d/dlogp = 1.5/3)
    # token-mean: (0.8 + 1.0 + 1.5) / 3 = 1.1
    assert loss == pytest.approx(1.1)
    assert grad == pytest.approx([0.0, 1.0 / 3, 1.5 / 3])
    assert m["pg_clipfrac"] == pytest.approx(1 / 3)


def test_ppo_clip_higher():
    inp = _inputs(LOGP, _old_for_ratios(LOGP, RATIOS), adv=[1.0, 1.0, 1.0])
    loss, grad, _ = _run(inp, GlobalCounts(tokens=3, sequences=1), clip_low=0.2, clip_high=0.28)
    # clip range [0.8, 1.28]; r=1.5 -> -1.28; (-0.5 - 1.0 - 1.28) / 3 = -0.926666...
    assert loss == pytest.approx(-2.78 / 3)
    assert grad == pytest.approx([-0.5 / 3, -1.0 / 3, 0.0])


def test_ppo_dual_clip():
    logp = [-1.0, -2.0, -0.5, -0.3]
    ratios = [0.5, 1.0, 1.5, 4.0]
    inp = _inputs(logp, _old_for_ratios(logp, ratios), adv=[-1.0] * 4)
    loss, grad, m = _run(inp, GlobalCounts(tokens=4, sequences=1), dual_clip=3.0)
    # A = -1, c = 3: loss = min(max(r, clip(r)), c |A|) = min(..., 3):
    #   r=0.5 -> 0.8, r=1 -> 1.0, r=1.5 -> 1.5, r=4 -> min(4, 3) = 3 (dual-clipped, no grad)
    # token-mean: (0.8 + 1 + 1.5 + 3) / 4 = 1.575
    assert loss == pytest.approx(1.575)
    assert grad == pytest.approx([0.0, 1.0 / 4, 1.5 / 4, 0.0])
    assert m["pg_clipfrac_lower"] == pytest.approx(1 / 4)


def test_gspo_sequence_ratio():
    # seq0: log-ratios [0.2, 0.4], A = -1; seq1: log-ratio [-0.1], A = +1. clip [0.8, 1.2].
    logp = [-1.0, -2.0, -0.5]
    old = [-1.2, -2.4, -0.4]
    inp = _inputs(logp, old, adv=[-1.0, -1.0, 1.0], lengths=[2, 1])
    loss, grad, m = _run(
        inp,
        GlobalCounts(tokens=3, sequences=2),
        policy_loss="gspo",
        loss_aggregation="seq-mean-token-mean",
    )
    s0 = math.exp(0.3)  # exp(mean(0.2, 0.4)) = 1.349859
    s1 = math.exp(-0.1)  # 0.904837
    # seq0: A<0 -> max(s0, clip(s0)=1.2) = s0 (unclipped); seq1: -min(s1, clip(s1)) = -s1
    # seq-mean-token-mean over G=2: (s0 + (-s1)) / 2 = 0.222511
    assert loss == pytest.approx((s0 - s1) / 2)
    # d/dlogp_t = (1/G)(1/n_i) * (-A) s_i:  seq0 tokens 0.5*0.5*s0, seq1 token 0.5*1*(-s1)
    assert grad == pytest.approx([0.25 * s0, 0.25 * s0, -0.5 * s1])
    assert m["pg_clipfrac"] == 0.0


def test_gspo_clipped_sequence_has_no_gradient():
    # one sequence, log-ratios [0.2, 0.4] -> s = e^0.3 = 1.3499 > 1.2, A = +1 -> clipped at 1.2
    inp = _inputs([-1.0, -2.0], [-1.2, -2.4], adv=[1.0, 1.0])
    loss, grad, m = _run(
        inp,
        GlobalCounts(tokens=2, sequences=1),
        policy_loss="gspo",
        loss_aggregation="seq-mean-token-mean",
    )
    assert loss == pytest.approx(-1.2)  # (1/2)(-1.2 - 1.2)
    assert grad == pytest.approx([0.0, 0.0])
    assert m["pg_clipfrac"] == 1.0


def test_cispo():
    inp = _inputs(LOGP, _old_for_ratios(LOGP, RATIOS), adv=[1.0, 1.0, 1.0])
    loss, grad, m = _run(inp, GlobalCounts(tokens=3, sequences=1), policy_loss="cispo")
    # weights sg(clip(r, 0.8, 1.2)) = [0.8, 1.0, 1.2]; loss_t = -w A logp = [0.8, 2.0, 0.6]
    # token-mean: 3.4 / 3; grad = -w A / 3 (every token keeps its gradient, even clipped ones)
    assert loss == pytest.approx(3.4 / 3)
    assert grad == pytest.approx([-0.8 / 3, -1.0 / 3, -1.2 / 3])
    assert m["pg_clipfrac"] == pytest.approx(2 / 3)


def test_reinforce():
    inp = _inputs([-0.5, -1.0], adv=[2.0, -1.0])
    loss, grad, _ = _run(inp, GlobalCounts(tokens=2, sequences=1), policy_loss="reinforce")
    # loss_t = -A logp = [1.0, -1.0]; token-mean 0; grad -A / 2 = [-1.0, 0.5]
    assert loss == pytest.approx(0.0)
    assert grad == pytest.approx([-1.0, 0.5])


def test_sft():
    inp = _inputs([-0.5, -1.0, -2.0], mask=[1, 1, 0])
    loss, grad, _ = _run(inp, GlobalCounts(tokens=2, sequences=1), policy_loss="sft")
    # masked NLL: (0.5 + 1.0) / 2 = 0.75; grad -1/2 on valid tokens, 0 on the masked one
    assert loss == pytest.approx(0.75)
    assert grad == pytest.approx([-0.5, -0.5, 0.0])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # l = [1, 2, (3 masked) | 4, 5, 6]; n = [2, 3], N = 5, G = 2, L = 10
        ("token-mean", (1 + 2 + 4 + 5 + 6) / 5),  # 18 / 5 = 3.6
        ("seq-mean-token-mean", ((1 + 2) / 2 + (4 + 5 + 6) / 3) / 2),  # (1.5 + 5) / 2 = 3.25
        ("seq-mean-token-sum", (3 + 15) / 2),  # 9
        ("seq-mean-token-sum-norm", 18 / (2 * 10)),  # 0.9
    ],
)
def test_aggregation_modes(mode, expected):
    inp = _inputs([0.0] * 6, mask=[1, 1, 0, 1, 1, 1], lengths=[3, 3])
    loss_t = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], dtype=F64, requires_grad=True)
    counts = GlobalCounts(tokens=5, sequences=2, norm_length=10)
    out = aggregate(loss_t, inp, counts, mode)
    assert out.item() == pytest.approx(expected)


def test_seq_mean_token_mean_uses_global_sequence_counts():
    # This rank holds 2 of the 4 valid tokens of sequence 0 (the rest on another CP rank):
    # its share is (1 + 2) / 4 / G with G = 1 -> 0.75, not (1 + 2) / 2.
    inp = LossInputs(
        logprobs=torch.zeros(2, dtype=F64),
        advantages=torch.zeros(2, dtype=F64),
        loss_mask=torch.ones(2),
        seq_ids=torch.zeros(2, dtype=torch.long),
        num_seqs=1,
        seq_token_counts=torch.tensor([4]),
    )
    loss_t = torch.tensor([1.0, 2.0], dtype=F64)
    out = aggregate(loss_t, inp, GlobalCounts(tokens=4, sequences=1), "seq-mean-token-mean")
    assert out.item() == pytest.approx(0.75)


def _correction_inputs(x, lengths=None):
    # reinforce with A = -1 and logp = 1: pg_t = -A logp = 1, so the token-mean loss is the mean
    # weight. old = 1 and rollout = old - x, so old - rollout = x.
    n = len(x)
    return _inputs(
        [1.0] * n,
        [1.0] * n,
        adv=[-1.0] * n,
        lengths=lengths,
        rollout_logprobs=[1.0 - xi for xi in x],
    )


RHO = [0.25, 0.6, 1.0, 1.9, 4.0]


def test_tis():
    inp = _correction_inputs([math.log(r) for r in RHO])
    loss, grad, m = _run(
        inp,
        GlobalCounts(tokens=5, sequences=1),
        policy_loss="reinforce",
        rollout_correction="tis",
        rollout_correction_high=2.0,
    )
    # w = min(rho, 2) = [0.25, 0.6, 1.0, 1.9, 2.0]; mean 5.75 / 5 = 1.15; 1 of 5 truncated
    assert m["is_weight_mean"] == pytest.approx(1.15)
    assert m["is_clipfrac"] == pytest.approx(0.2)
    assert loss == pytest.approx(1.15)  # pg_t = 1 weighted by w
    # d/dlogp of w_t (-A logp_t) / 5 = w_t / 5: the weight scales the gradient
    assert grad == pytest.approx([0.05, 0.12, 0.2, 0.38, 0.4])
    # |old - rollout| = |log rho| = [1.386294, 0.510826, 0, 0.641854, 1.386294] / 5
    assert m["train_rollout_logprob_abs_diff"] == pytest.approx(
        sum(abs(math.log(r)) for r in RHO) / 5
    )


def test_icepop():
    inp = _correction_inputs([math.log(r) for r in RHO])
    loss, _, m = _run(
        inp,
        GlobalCounts(tokens=5, sequences=1),
        policy_loss="reinforce",
        rollout_correction="icepop",
    )
    # [0.5, 2]: w = [0, 0.6, 1.0, 1.9, 0]; mean 3.5 / 5 = 0.7; 2 of 5 masked
    assert m["is_weight_mean"] == pytest.approx(0.7)
    assert m["is_clipfrac"] == pytest.approx(0.4)
    assert loss == pytest.approx(0.7)


def test_seq_mask():
    # seq0: log-ratios [log 9, 0] -> geometric mean exp(log 9 / 2) = 3 > 2   -> masked
    # seq1: [log 0.8, log 1.25] -> mean log 1 -> 1 inside [0.5, 2]          -> kept
    # seq2: [log 0.3] -> 0.3 < 0.5                                          -> masked
    x = [math.log(9), 0.0, math.log(0.8), math.log(1.25), math.log(0.3)]
    inp = _correction_inputs(x, lengths=[2, 2, 1])
    loss, _, m = _run(
        inp,
        GlobalCounts(tokens=5, sequences=3),
        policy_loss="reinforce",
        rollout_correction="seq_mask",
    )
    # w = [0, 0, 1, 1, 0]: mean 2/5, masked 3/5; loss = (0+0+1+1+0)/5
    assert m["is_weight_mean"] == pytest.approx(0.4)
    assert m["is_clipfrac"] == pytest.approx(0.6)
    assert loss == pytest.approx(0.4)


def test_value_loss_clipped():
    v = torch.tensor([1.0, 2.0, 0.5], dtype=F64, requires_grad=True)
    old_v = torch.tensor([0.5, 1.0, 0.5], dtype=F64)
    returns = torch.tensor([1.5, 1.0, 0.0], dtype=F64)
    loss_t, clipped = value_loss(v, returns, old_v, 0.2)
    # t0: (1-1.5)^2 = 0.25; v_clip = 0.5 + clip(0.5, +-0.2) = 0.7, (0.7-1.5)^2 = 0.64 -> 0.5*0.64
    # t1: (2-1)^2 = 1;      v_clip = 1.2, (1.2-1)^2 = 0.04                       -> 0.5*1
    # t2: (0.5-0)^2 = 0.25; v_clip = 0.5 (no move), same                           -> 0.5*0.25
    assert loss_t.tolist() == pytest.approx([0.32, 0.5, 0.125])
    assert clipped.tolist() == [True, False, False]
    (grad,) = torch.autograd.grad(loss_t.sum(), v)
    # t0: clipped branch, v_clip saturated -> 0; t1: (v - R) = 1; t2: (v - R) = 0.5
    assert grad.tolist() == pytest.approx([0.0, 1.0, 0.5])


def test_value_clip_flags_only_where_the_clip_acts():
    """A value inside ``old +- c`` is not clipped, whatever the float rounding of ``v - old``:
    fp32 values where ``old + (v - old)`` rounds away from ``v`` (the old clip flagged those as
    clipped, and different ones on each backend: `critic/vf_clipfrac` 0.039 on Megatron against
    0.080 on DeepSpeed at one step of the PPO example)."""
    # Found by search: for each pair, old + (v - old) != v in fp32, and |v - old| < c.
    g = torch.Generator().manual_seed(0)
    v = torch.randn(4000, generator=g)
    old = v + 0.05 * torch.randn(4000, generator=g)
    returns = torch.randn(4000, generator=g)
    tie = (old + (v - old)) != v
    assert tie.sum() > 50 and ((v - old).abs() < 0.2).all()
    loss_t, clipped = value_loss(v, returns, old, 0.2)
    assert not clipped.any()
    # nothing clipped: exactly the plain loss 0.5 (v - R)^2, computed here in float64
    plain = 0.5 * (v.double() - returns.double()).square()
    torch.testing.assert_close(loss_t.double(), plain, rtol=1e-6, atol=0)


def test_value_term_in_compute_loss():
    inp = _inputs(
        [-1.0, -1.0, -1.0],
        adv=[0.0, 0.0, 0.0],
        values=[1.0, 2.0, 0.5],
        old_values=[0.5, 1.0, 0.5],
        returns=[1.5, 1.0, 0.0],
    )
    out = compute_loss(inp, GlobalCounts(tokens=3, sequences=1), LossSettings(value_coef=0.5))
    m = reduce_metrics([out.metrics])
    # value loss token-mean (0.32 + 0.5 + 0.125) / 3 = 0.315; loss = 0.5 * 0.315 (pg = 0, A = 0)
    assert m["value_loss"] == pytest.approx(0.315)
    assert m["vf_clipfrac"] == pytest.approx(1 / 3)
    assert out.loss.item() == pytest.approx(0.1575)


def test_value_unclipped():
    v = torch.tensor([1.0, 3.0], dtype=F64)
    loss_t, clipped = value_loss(v, torch.tensor([0.0, 1.0], dtype=F64), None, None)
    assert loss_t.tolist() == pytest.approx([0.5, 2.0])  # 0.5 * [1, 4]
    assert not clipped.any()


def test_kl_and_entropy_terms():
    # logp - ref = [0.5, -0.5]; k1 = logp - ref; entropy H = [1.0, 3.0]
    inp = _inputs([-1.0, -2.0], adv=[0.0, 0.0], ref_logprobs=[-1.5, -1.5], entropy=[1.0, 3.0])
    settings = LossSettings(kl_loss_coef=0.1, kl_loss_estimator="k1", entropy_coef=0.01)
    out = compute_loss(inp, GlobalCounts(tokens=2, sequences=1), settings)
    m = reduce_metrics([out.metrics])
    # kl = mean(0.5, -0.5) = 0; entropy mean 2.0; loss = 0.1*0 - 0.01*2 = -0.02
    assert m["kl"] == pytest.approx(0.0)
    assert m["entropy"] == pytest.approx(2.0)
    assert out.loss.item() == pytest.approx(-0.02)
    (grad,) = torch.autograd.grad(out.loss, inp.logprobs)
    assert grad.tolist() == pytest.approx([0.1 / 2, 0.1 / 2])  # d k1 / d logp = 1, mean over 2
