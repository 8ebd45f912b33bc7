"""`compute_loss` against a per-token Python loop written from the papers' formulas, on random
batches in fp64: the loss, every metric, and the gradients (autograd through the loop)."""

from __future__ import annotations

import math

import pytest
import torch

from unirl.core.data.counts import GlobalCounts
from unirl.core.maths.losses import (
    AGGREGATION_MODES,
    LossInputs,
    LossSettings,
    compute_loss,
    reduce_metrics,
)

F64 = torch.float64
POLICIES = ["ppo_clip", "gspo", "cispo", "reinforce", "sft"]
CORRECTIONS = ["none", "tis", "icepop", "seq_mask"]
NORM_LENGTH = 16


def make_batch(seed: int, num_seqs: int = 6, optional: bool = True) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 8, (num_seqs,), generator=g).tolist()
    n = sum(lengths)

    def randn(scale=1.0):
        return torch.randn(n, generator=g, dtype=F64) * scale

    mask = torch.rand(n, generator=g) < 0.8
    mask[n - lengths[-1] :] = False  # the last sequence is fully masked
    old = -torch.rand(n, generator=g, dtype=F64) * 2 - 0.1
    b = {
        "lengths": lengths,
        "mask": mask,
        "logprobs": (old + randn(0.35)).requires_grad_(),
        "advantages": randn(),
        "old_logprobs": old if optional else None,
    }
    if optional:
        b |= {
            "rollout_logprobs": old + randn(0.4),
            "ref_logprobs": old + randn(0.5),
            "entropy": (torch.rand(n, generator=g, dtype=F64) * 2).requires_grad_(),
            "values": randn().requires_grad_(),
            "old_values": None,
            "returns": randn(),
        }
        b["old_values"] = b["values"].detach() + randn(0.3)
    return b


def to_inputs(b: dict) -> LossInputs:
    lengths = b["lengths"]
    seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    counts = [0] * len(lengths)
    for t, s in enumerate(seq_ids.tolist()):
        counts[s] += int(b["mask"][t])
    fields = [
        "logprobs",
        "advantages",
        "old_logprobs",
        "rollout_logprobs",
        "ref_logprobs",
        "entropy",
        "values",
        "old_values",
        "returns",
    ]
    return LossInputs(
        loss_mask=b["mask"],
        seq_ids=seq_ids,
        num_seqs=len(lengths),
        seq_token_counts=torch.tensor(counts),
        **{k: b[k] for k in fields if k in b},
    )


def loop_reference(b: dict, s: LossSettings) -> tuple[torch.Tensor, dict[str, float]]:
    """The objective and metrics, one sequence and one token at a time (objective form:
    maximise ``min(r A, clip(r) A)``, then negate)."""
    lp, adv, m = b["logprobs"], b["advantages"], b["mask"].tolist()
    old = b["old_logprobs"] if b["old_logprobs"] is not None else lp.detach()
    roll, ref, ent = b.get("rollout_logprobs"), b.get("ref_logprobs"), b.get("entropy")
    vals, old_vals, rets = b.get("values"), b.get("old_values"), b.get("returns")
    lo, hi = 1 - s.clip_low, 1 + s.clip_high
    rlo, rhi = s.rollout_correction_low, s.rollout_correction_high

    seqs, start = [], 0
    for n in b["lengths"]:
        seqs.append([t for t in range(start, start + n) if m[t]])
        start += n
    num_tokens = sum(len(toks) for toks in seqs)
    num_seqs = sum(1 for toks in seqs if toks)

    def agg(per_seq_sums: list) -> torch.Tensor:
        out = torch.zeros((), dtype=F64)
        for toks, total in zip(seqs, per_seq_sums):
            if not toks:
                continue
            if s.loss_aggregation == "token-mean":
                out = out + total / num_tokens
            elif s.loss_aggregation == "seq-mean-token-mean":
                out = out + total / len(toks) / num_seqs
            elif s.loss_aggregation == "seq-mean-token-sum":
                out = out + total / num_seqs
            else:
                out = out + total / (num_seqs * NORM_LENGTH)
        return out

    def kl(t):
        d = lp[t] - ref[t]
        if s.kl_loss_estimator == "k1":
            return d
        k3 = torch.exp(-d) + d - 1
        return torch.clamp(k3, -10.0, 10.0)  # low_var_kl

    sums = {k: [] for k in ("total", "pg", "kl", "value")}
    tok = dict.fromkeys(
        ("clip", "ppo_kl", "kl", "ent", "w", "is_clip", "absdiff", "roll_kl", "vf_clip"), 0.0
    )
    absdiff_max = float("-inf")
    for toks in seqs:
        acc = dict.fromkeys(sums, 0.0)
        if toks:
            seq_lr = sum(lp[t].item() - old[t].item() for t in toks) / len(toks)
            if roll is not None:
                seq_rho = math.exp(sum(old[t].item() - roll[t].item() for t in toks) / len(toks))
        for t in toks:
            a = adv[t].item()
            if s.policy_loss == "ppo_clip":
                r = torch.exp(lp[t] - old[t])
                obj = min(r * a, torch.clamp(r, lo, hi) * a)
                tok["clip"] += float((torch.clamp(r, lo, hi) * a).item() < (r * a).item())
                if s.dual_clip is not None and a < 0:
                    obj = max(obj, torch.tensor(s.dual_clip * a, dtype=F64))
                pg = -obj
            elif s.policy_loss == "gspo":
                # value s_i, gradient of the token's own log-prob: sg(s_i) exp(lp - sg(lp))
                r = math.exp(seq_lr) * torch.exp(lp[t] - lp[t].detach())
                obj = min(r * a, torch.clamp(r, lo, hi) * a)
                tok["clip"] += float(min(max(math.exp(seq_lr), lo), hi) * a < math.exp(seq_lr) * a)
                pg = -obj
            elif s.policy_loss == "cispo":
                r = math.exp(lp[t].item() - old[t].item())
                tok["clip"] += float(r < lo or r > hi)
                pg = -min(max(r, lo), hi) * a * lp[t]
            elif s.policy_loss == "reinforce":
                pg = -a * lp[t]
            else:
                pg = -lp[t]
            w = 1.0
            if s.rollout_correction != "none":
                rho = math.exp(old[t].item() - roll[t].item())
                if s.rollout_correction == "tis":
                    w, cut = min(rho, rhi), rho > rhi
                elif s.rollout_correction == "icepop":
                    w, cut = (rho, False) if rlo <= rho <= rhi else (0.0, True)
                else:
                    w, cut = (1.0, False) if rlo <= seq_rho <= rhi else (0.0, True)
                tok["w"] += w
                tok["is_clip"] += float(cut)
            term = w * pg
            acc["pg"] = acc["pg"] + w * pg
            tok["ppo_kl"] += old[t].item() - lp[t].item()
            if roll is not None:
                diff = old[t].item() - roll[t].item()
                tok["absdiff"] += abs(diff)
                absdiff_max = max(absdiff_max, abs(diff))
                # KL(rollout || train), k3 on a rollout token: e^d - 1 - d, d = train - rollout
                tok["roll_kl"] += math.exp(diff) - 1 - diff
            if ref is not None:
                k = kl(t)
                tok["kl"] += k.item()
                acc["kl"] = acc["kl"] + k
                term = term + s.kl_loss_coef * k
            if ent is not None:
                tok["ent"] += ent[t].item()
                term = term - s.entropy_coef * ent[t]
            if vals is not None:
                v, ov, ret = vals[t], old_vals[t].item(), rets[t].item()
                v_clip = ov + torch.clamp(v - ov, -s.value_clip, s.value_clip)
                e1, e2 = (v - ret) ** 2, (v_clip - ret) ** 2
                tok["vf_clip"] += float(e2.item() > e1.item())
                vl = 0.5 * max(e1, e2)
                acc["value"] = acc["value"] + vl
                term = term + s.value_coef * vl
            acc["total"] = acc["total"] + term
        for k in sums:
            sums[k].append(acc[k])

    loss = agg(sums["total"])
    metrics = {
        "loss": loss.item(),
        "pg_loss": agg(sums["pg"]).item(),
        "ppo_kl": tok["ppo_kl"] / num_tokens,
    }
    if s.policy_loss in ("ppo_clip", "gspo", "cispo"):
        metrics["pg_clipfrac"] = tok["clip"] / num_tokens
    if s.rollout_correction != "none":
        metrics |= {
            "is_weight_mean": tok["w"] / num_tokens,
            "is_clipfrac": tok["is_clip"] / num_tokens,
        }
    if roll is not None:
        metrics["train_rollout_logprob_abs_diff"] = tok["absdiff"] / num_tokens
        metrics["train_rollout_logprob_abs_diff_max"] = absdiff_max if num_tokens else 0.0
        metrics["train_rollout_kl"] = tok["roll_kl"] / num_tokens
    if ref is not None:
        metrics |= {"kl": tok["kl"] / num_tokens, "kl_loss": agg(sums["kl"]).item()}
    if ent is not None:
        metrics["entropy"] = tok["ent"] / num_tokens
    if vals is not None:
        metrics |= {
            "value_loss": agg(sums["value"]).item(),
            "vf_clipfrac": tok["vf_clip"] / num_tokens,
        }
    return loss, metrics


def _counts(b: dict) -> GlobalCounts:
    mask, tokens, seqs, start = b["mask"].tolist(), 0, 0, 0
    for n in b["lengths"]:
        valid = sum(mask[start : start + n])
        tokens, seqs, start = tokens + valid, seqs + (valid > 0), start + n
    return GlobalCounts(tokens=tokens, sequences=seqs, norm_length=NORM_LENGTH)


def _leaves(b: dict) -> list[torch.Tensor]:
    return [b[k] for k in ("logprobs", "entropy", "values") if b.get(k) is not None]


def _check(b: dict, settings: LossSettings) -> None:
    out = compute_loss(to_inputs(b), _counts(b), settings)
    got_grads = torch.autograd.grad(out.loss, _leaves(b), allow_unused=True)
    got_metrics = reduce_metrics([out.metrics])

    ref_loss, ref_metrics = loop_reference(b, settings)
    ref_grads = torch.autograd.grad(ref_loss, _leaves(b), allow_unused=True)

    assert out.loss.item() == pytest.approx(ref_loss.item(), rel=1e-10, abs=1e-12)
    for leaf, got, ref in zip(_leaves(b), got_grads, ref_grads):
        # None: the leaf does not enter that loss (e.g. entropy with entropy_coef 0)
        got = torch.zeros_like(leaf) if got is None else got
        ref = torch.zeros_like(leaf) if ref is None else ref
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    got_metrics.pop("pg_clipfrac_lower", None)
    assert got_metrics.keys() == ref_metrics.keys()
    for name, value in ref_metrics.items():
        assert got_metrics[name] == pytest.approx(value, rel=1e-10, abs=1e-12), name


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@pytest.mark.parametrize("policy", POLICIES)
def test_every_loss_and_aggregation(policy, mode):
    i = POLICIES.index(policy) * 4 + AGGREGATION_MODES.index(mode)
    settings = LossSettings(
        policy_loss=policy,
        loss_aggregation=mode,
        clip_low=0.2,
        clip_high=0.28,
        dual_clip=1.5 if policy == "ppo_clip" else None,  # r > 1.5 occurs
        kl_loss_coef=0.1,
        kl_loss_estimator="low_var_kl",
        entropy_coef=0.01,
        rollout_correction=CORRECTIONS[i % 4],
        value_coef=0.5,
        value_clip=0.2,
    )
    _check(make_batch(seed=i), settings)


@pytest.mark.parametrize("correction", CORRECTIONS)
def test_every_rollout_correction(correction):
    # k1 KL (can be negative), no entropy bonus; the batch is large enough to hit every branch
    settings = LossSettings(
        rollout_correction=correction,
        kl_loss_coef=0.05,
        kl_loss_estimator="k1",
        rollout_correction_low=0.7,
        rollout_correction_high=1.3,
    )
    _check(make_batch(seed=100 + CORRECTIONS.index(correction), num_seqs=10), settings)


@pytest.mark.parametrize("policy", POLICIES)
def test_minimal_inputs_reuse_old_logprobs(policy):
    # old_logprobs None: reuse the forward's own (ratio 1); no ref, entropy, values
    b = make_batch(seed=7, optional=False)
    _check(b, LossSettings(policy_loss=policy))


def test_gspo_matches_sequence_level_objective():
    """GSPO's own sequence-level form (Zheng et al. 2025, eq. 5), with one advantage per
    sequence: J = (1/G) sum_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t(logp - old))
    with the gradient flowing through s_i itself (no stop-gradient anywhere)."""
    b = make_batch(seed=11, num_seqs=8, optional=False)
    b["old_logprobs"] = (
        b["logprobs"].detach()
        + torch.randn(b["logprobs"].shape, generator=torch.Generator().manual_seed(1), dtype=F64)
        * 0.15
    )
    adv, start = b["advantages"].clone(), 0
    for n in b["lengths"]:
        adv[start : start + n] = adv[start]  # sequence-level advantages
        start += n
    b["advantages"] = adv
    settings = LossSettings(
        policy_loss="gspo", loss_aggregation="seq-mean-token-mean", clip_low=0.05, clip_high=0.08
    )

    lp, old, mask = b["logprobs"], b["old_logprobs"], b["mask"].tolist()
    objective, start, groups = torch.zeros((), dtype=F64), 0, 0
    clipped_any = unclipped_any = False
    for n in b["lengths"]:
        toks = [t for t in range(start, start + n) if mask[t]]
        a = adv[start].item()
        start += n
        if not toks:
            continue
        groups += 1
        s_i = torch.exp(sum(lp[t] - old[t] for t in toks) / len(toks))
        clipped = torch.clamp(s_i, 0.95, 1.08) * a
        objective = objective + min(s_i * a, clipped)
        clipped_any |= (clipped < s_i * a).item()
        unclipped_any |= not (clipped < s_i * a).item()
    assert clipped_any and unclipped_any  # both branches exercised
    ref_loss = -objective / groups
    (ref_grad,) = torch.autograd.grad(ref_loss, lp)

    out = compute_loss(to_inputs(b), _counts(b), settings)
    (grad,) = torch.autograd.grad(out.loss, lp)
    assert out.loss.item() == pytest.approx(ref_loss.item(), rel=1e-10)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
