"""Context parallel on gloo: CP=2 and CP=4 give the loss and the gradients of CP=1.

One packed microbatch of five sequences: one long, one shorter than ``2*cp`` tokens, one with a
single response token, one with a masked token inside the response, one with no valid token.
Every rank builds the same global stream, shifts targets on it, splits it with `CPLayout`, runs a
toy model on its local tokens (logits from the token and its GLOBAL position) and `compute_loss`.
The CP=1 reference runs in the parent: the same toy model on the unsplit stream, then a plain
fp64 per-sequence Python loop of the PPO / GSPO formulas, written here.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist

from tests.spawn import run_distributed
from unirl.core.data.context_parallel import (
    CPLayout,
    cp_all_reduce,
    gather_from_cp,
    shift_to_next_token,
)
from unirl.core.data.counts import GlobalCounts
from unirl.core.maths.losses import LossInputs, LossSettings, compute_loss, reduce_metrics

VOCAB = 11
MAX_POS = 16
# (prompt length, response length, response positions masked out of the loss)
SEQUENCES = [
    (4, 5, ()),  # 9 tokens
    (1, 2, ()),  # 3 tokens: shorter than 2*cp for cp = 2 and 4
    (3, 1, ()),  # a single response token -> one valid position
    (5, 8, (3,)),  # a masked token inside the response (e.g. a tool output)
    (4, 2, (0, 1)),  # no valid token at all
]
ADVANTAGES = [1.5, -0.7, 2.0, -1.2, 0.9]  # one per sequence (GRPO-style)
# Other DP ranks / microbatches of the step hold more: the normalisers are the step's, not ours.
EXTRA_TOKENS, EXTRA_SEQS = 6, 2

CASES = {
    "ppo_token_mean": dict(policy_loss="ppo_clip", loss_aggregation="token-mean"),
    "ppo_seq_mean": dict(policy_loss="ppo_clip", loss_aggregation="seq-mean-token-mean"),
    "gspo_seq_mean": dict(policy_loss="gspo", loss_aggregation="seq-mean-token-mean"),
    "gspo_token_mean": dict(policy_loss="gspo", loss_aggregation="token-mean"),
}
CLIP = {"ppo_clip": (0.2, 0.28), "gspo": (0.01, 0.02)}  # asymmetric, so each bound is exercised


def build_batch() -> dict:
    """The global (unsplit) microbatch, identical on every process; the reference builds its own
    positions, targets and loss mask by plain loops, not with the code under test."""
    g = torch.Generator().manual_seed(1234)
    lengths = [p + r for p, r, _ in SEQUENCES]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    total = int(cu[-1])
    tokens = torch.randint(0, VOCAB, (total,), generator=g)
    response = torch.zeros(total, dtype=torch.bool)
    adv = torch.zeros(total, dtype=torch.float64)
    for i, (p, r, masked) in enumerate(SEQUENCES):
        s = int(cu[i])
        for k in range(r):
            response[s + p + k] = k not in masked
        adv[s : int(cu[i + 1])] = ADVANTAGES[i]
    return {
        "cu": cu,
        "tokens": tokens,
        "response": response,
        "advantages": adv,
        # Old log-probs per position: spread so that some ratios leave the clip range.
        "old_noise": 0.35 * torch.randn(total, generator=g, dtype=torch.float64),
        "emb": torch.randn(VOCAB, VOCAB, generator=g, dtype=torch.float64),
        "pos": 0.5 * torch.randn(MAX_POS, VOCAB, generator=g, dtype=torch.float64),
    }


def toy_logprobs(emb, pos, tokens, position_ids, targets):
    """log p(target | token, global position): a model whose output depends on the position."""
    logits = emb[tokens] + pos[position_ids]
    return torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)


# -- CP side (each rank) ----------------------------------------------------------------------


def _cp_worker(rank: int, world_size: int) -> bytes:
    # Returned as bytes: tensors sent through the result queue as shared-memory handles can
    # vanish when the worker exits before the parent unpickles them.
    buf = io.BytesIO()
    torch.save(_cp_results(rank, world_size), buf)
    return buf.getvalue()


def _cp_results(rank: int, world_size: int) -> dict:
    group = dist.new_group(list(range(world_size)))
    b = build_batch()
    cu = b["cu"]
    lay = CPLayout.build(cu, world_size, rank)
    # Shift on the GLOBAL stream, then split every per-token tensor the same way.
    targets = shift_to_next_token(b["tokens"], cu)
    loss_mask = shift_to_next_token(b["response"], cu, fill=False)
    seq_counts = torch.tensor(
        [int(loss_mask[int(cu[i]) : int(cu[i + 1])].sum()) for i in range(len(SEQUENCES))]
    )
    counts = GlobalCounts(
        tokens=int(seq_counts.sum()) + EXTRA_TOKENS,
        sequences=int((seq_counts > 0).sum()) + EXTRA_SEQS,
    )
    out: dict = {"layout_positions": lay.position_ids}
    for name, kw in CASES.items():
        emb = b["emb"].clone().requires_grad_()
        pos = b["pos"].clone().requires_grad_()
        logp = toy_logprobs(emb, pos, lay.split(b["tokens"]), lay.position_ids, lay.split(targets))
        logp.retain_grad()
        # old log-probs: this rank's detached log-probs shifted by the (split) global noise
        old = logp.detach() + lay.split(b["old_noise"])
        inp = LossInputs(
            logprobs=logp,
            old_logprobs=old,
            advantages=lay.split(b["advantages"]),
            loss_mask=lay.split(loss_mask, pad_value=False),
            seq_ids=lay.seq_ids,
            num_seqs=len(SEQUENCES),
            seq_token_counts=seq_counts,
            cp_group=group,
        )
        lo, hi = CLIP[kw["policy_loss"]]
        settings = LossSettings(clip_low=lo, clip_high=hi, **kw)
        res = compute_loss(inp, counts, settings)
        res.loss.backward()
        # Megatron all-reduces parameter grads over dp x cp; over CP ranks that is this sum.
        emb_grad, pos_grad = emb.grad.clone(), pos.grad.clone()
        dist.all_reduce(emb_grad, group=group)
        dist.all_reduce(pos_grad, group=group)
        out[name] = {
            "loss": res.loss.detach(),
            "logp": gather_from_cp(logp, cu, group),
            "logp_grad": gather_from_cp(logp.grad, cu, group),
            "emb_grad": emb_grad,
            "pos_grad": pos_grad,
            "clipfrac": reduce_metrics([res.metrics], group=group)["pg_clipfrac"],
        }

    # cp_all_reduce's own gradient: y = sum_r x_r; rank r's loss is (r + 1) * sum_j y_j^2.
    x_r = torch.tensor([1.0 + rank, 2.0 - rank], dtype=torch.float64, requires_grad=True)
    y = cp_all_reduce(x_r, group)
    ((rank + 1.0) * y.square()).sum().backward()
    out["all_reduce"] = {"y": y.detach(), "grad": x_r.grad}
    return out


# -- CP = 1 reference (plain torch, per-sequence loops) ----------------------------------------


def reference(case: str) -> dict:
    b = build_batch()
    cu = b["cu"].tolist()
    total = cu[-1]
    tokens = b["tokens"]
    positions = torch.zeros(total, dtype=torch.long)
    targets = torch.zeros(total, dtype=torch.long)
    mask = torch.zeros(total, dtype=torch.bool)
    for i in range(len(SEQUENCES)):
        for t in range(cu[i], cu[i + 1]):
            positions[t] = t - cu[i]
            if t + 1 < cu[i + 1]:  # position t predicts token t+1 of the same sequence
                targets[t] = tokens[t + 1]
                mask[t] = bool(b["response"][t + 1])
    emb = b["emb"].clone().requires_grad_()
    pos = b["pos"].clone().requires_grad_()
    logp = toy_logprobs(emb, pos, tokens, positions, targets)
    logp.retain_grad()
    old = logp.detach() + b["old_noise"]
    adv = b["advantages"]
    n = [int(mask[cu[i] : cu[i + 1]].sum()) for i in range(len(SEQUENCES))]
    big_n = sum(n) + EXTRA_TOKENS
    big_g = sum(1 for k in n if k > 0) + EXTRA_SEQS
    kw = CASES[case]
    lo, hi = CLIP[kw["policy_loss"]]
    token_mean = kw["loss_aggregation"] == "token-mean"

    loss = torch.zeros((), dtype=torch.float64)
    clipped, valid = 0, 0
    for i in range(len(SEQUENCES)):
        if n[i] == 0:
            continue  # contributes nothing; must not divide by its zero count
        idx = [t for t in range(cu[i], cu[i + 1]) if mask[t]]
        if kw["policy_loss"] == "ppo_clip":
            # l_t = max(-A r_t, -A clip(r_t, 1 - lo, 1 + hi)),  r_t = exp(logp_t - old_t)
            seq_sum = torch.zeros((), dtype=torch.float64)
            for t in idx:
                r = torch.exp(logp[t] - old[t])
                a = adv[t]
                unclipped, clip_term = -a * r, -a * r.clamp(1 - lo, 1 + hi)
                clipped += int(clip_term > unclipped)
                seq_sum = seq_sum + torch.maximum(unclipped, clip_term)
            loss = loss + (seq_sum / big_n if token_mean else seq_sum / n[i] / big_g)
        else:
            # GSPO: s_i = exp(mean_t (logp_t - old_t)); L_i = max(-A s_i, -A clip(s_i)).
            s = torch.exp(sum(logp[t] - old[t] for t in idx) / n[i])
            a = adv[cu[i]]
            unclipped, clip_term = -a * s, -a * s.clamp(1 - lo, 1 + hi)
            clipped += n[i] * int(clip_term > unclipped)  # every token carries s_i
            seq_loss = torch.maximum(unclipped, clip_term)
            # token-mean weighs a sequence by its n_i tokens; seq-mean weighs each sequence 1.
            loss = loss + (n[i] * seq_loss / big_n if token_mean else seq_loss / big_g)
        valid += n[i]
    loss.backward()
    return {
        "loss": loss.detach(),
        "logp": logp.detach(),
        "logp_grad": logp.grad,
        "emb_grad": emb.grad,
        "pos_grad": pos.grad,
        "clipfrac": clipped / valid,
    }


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def cp_run(request) -> tuple[int, list[dict]]:
    raw = run_distributed(_cp_worker, request.param)
    return request.param, [torch.load(io.BytesIO(r)) for r in raw]


@pytest.mark.parametrize("case", list(CASES))
def test_cp_matches_single_rank(cp_run, case):
    _, results = cp_run
    ref = reference(case)
    # The test is only meaningful if both branches of the clip occur.
    assert 0 < ref["clipfrac"] < 1, ref["clipfrac"]
    # Every rank's share is its own; the shares of the CP ranks sum to the CP=1 loss.
    cp_loss = sum(r[case]["loss"] for r in results)
    torch.testing.assert_close(cp_loss, ref["loss"], rtol=1e-12, atol=1e-12)
    for rank, r in enumerate(results):
        got = r[case]
        torch.testing.assert_close(got["logp"], ref["logp"], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["logp_grad"], ref["logp_grad"], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(got["emb_grad"], ref["emb_grad"], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(got["pos_grad"], ref["pos_grad"], rtol=1e-10, atol=1e-12)
        assert got["clipfrac"] == pytest.approx(ref["clipfrac"], abs=1e-12), rank
    # Not vacuous: the loss and its gradient are non-zero.
    assert ref["loss"].abs() > 1e-3
    assert ref["logp_grad"].abs().sum() > 1e-3


def test_every_rank_holds_a_balanced_share(cp_run):
    cp, results = cp_run
    # Sequence i is padded to a multiple of 2cp; each rank holds padded_i / cp of its positions.
    padded = [-(-(p + r) // (2 * cp)) * 2 * cp for p, r, _ in SEQUENCES]
    for r in results:
        assert len(r["layout_positions"]) == sum(padded) // cp
    start = 0
    for n in padded:
        pieces = [r["layout_positions"][start : start + n // cp].tolist() for r in results]
        start += n // cp
        # The ranks' pieces cover the padded sequence exactly once ...
        assert sorted(p for piece in pieces for p in piece) == list(range(n))
        # ... and carry equal causal-attention work (query at p sees p + 1 keys).
        assert len({sum(p + 1 for p in piece) for piece in pieces}) == 1


def test_all_reduce_gradient(cp_run):
    cp, results = cp_run
    # x_r = [1 + r, 2 - r]; y = sum_r x_r = [cp(cp+1)/2, 2cp - cp(cp-1)/2]
    y = [cp * (cp + 1) / 2, 2 * cp - cp * (cp - 1) / 2]
    # L = sum_r (r + 1) * sum_j y_j^2 = (cp(cp+1)/2) * sum_j y_j^2, so dL/dx_r = cp(cp+1) * y.
    grad = [cp * (cp + 1) * v for v in y]
    for r in results:
        assert r["all_reduce"]["y"].tolist() == y
        assert r["all_reduce"]["grad"].tolist() == grad
