"""The loss contract: local losses summed over microbatches (and over the token shards of a
sequence) equal the loss of the whole step, with the same gradients, because every normaliser
comes from `GlobalCounts` and the global per-sequence token counts."""

from __future__ import annotations

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
POLICIES = ["ppo_clip", "gspo", "cispo", "reinforce", "sft", "stable_reinforce"]


def make_step(seed: int, num_seqs: int = 12):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (num_seqs,), generator=g)
    n = int(lengths.sum())
    seq_ids = torch.repeat_interleave(torch.arange(num_seqs), lengths)
    mask = torch.rand(n, generator=g) < 0.75
    mask[seq_ids == 3] = False  # one sequence with no valid token
    old = -torch.rand(n, generator=g, dtype=F64) * 2

    def near(x, scale):
        return x + torch.randn(n, generator=g, dtype=F64) * scale

    step = {
        "logprobs": near(old, 0.3).requires_grad_(),
        "old_logprobs": old,
        "rollout_logprobs": near(old, 0.3),
        "ref_logprobs": near(old, 0.4),
        "advantages": torch.randn(n, generator=g, dtype=F64),
        "entropy": torch.rand(n, generator=g, dtype=F64).requires_grad_(),
        "values": torch.randn(n, generator=g, dtype=F64).requires_grad_(),
        "returns": torch.randn(n, generator=g, dtype=F64),
        "loss_mask": mask,
    }
    step["old_values"] = near(step["values"].detach(), 0.3)
    seq_counts = torch.zeros(num_seqs, dtype=torch.long).index_add(0, seq_ids, mask.long())
    counts = GlobalCounts(
        tokens=int(mask.sum()), sequences=int((seq_counts > 0).sum()), norm_length=12
    )
    return step, seq_ids, seq_counts, counts


def inputs_for(step, seq_ids, seq_counts, token_idx: torch.Tensor) -> LossInputs:
    """The microbatch of the tokens ``token_idx`` (whole or partial sequences), with local
    sequence ids and the GLOBAL per-sequence counts. Indexing keeps the graph to the leaves."""
    global_seqs, local_ids = torch.unique(seq_ids[token_idx], return_inverse=True)
    return LossInputs(
        seq_ids=local_ids,
        num_seqs=global_seqs.numel(),
        seq_token_counts=seq_counts[global_seqs],
        **{k: v[token_idx] for k, v in step.items()},
    )


def _settings(policy: str, mode: str, correction: str) -> LossSettings:
    return LossSettings(
        policy_loss=policy,
        loss_aggregation=mode,
        clip_high=0.28,
        kl_loss_coef=0.1,
        entropy_coef=0.01,
        rollout_correction=correction,
        value_coef=0.5,
        # read by stable_reinforce only (set beside another loss it is refused)
        stable_reinforce_kl_coef=0.2 if policy == "stable_reinforce" else 0.0,
    )


def _loss_grads_metrics(step, seq_ids, seq_counts, counts, settings, parts):
    leaves = [step["logprobs"], step["entropy"], step["values"]]
    total, metrics = torch.zeros((), dtype=F64), []
    for token_idx in parts:
        out = compute_loss(inputs_for(step, seq_ids, seq_counts, token_idx), counts, settings)
        total = total + out.loss
        metrics.append(out.metrics)
    return total, torch.autograd.grad(total, leaves), reduce_metrics(metrics)


def _assert_same(whole, split):
    loss_w, grads_w, metrics_w = whole
    loss_s, grads_s, metrics_s = split
    assert loss_s.item() == pytest.approx(loss_w.item(), rel=1e-12, abs=1e-14)
    for gw, gs in zip(grads_w, grads_s):
        torch.testing.assert_close(gs, gw, rtol=1e-12, atol=1e-14)
    assert metrics_s.keys() == metrics_w.keys()
    for name in metrics_w:
        assert metrics_s[name] == pytest.approx(metrics_w[name], rel=1e-12, abs=1e-14), name


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@pytest.mark.parametrize("policy", POLICIES)
def test_random_microbatch_split(policy, mode):
    seed = POLICIES.index(policy) * 4 + AGGREGATION_MODES.index(mode)
    step, seq_ids, seq_counts, counts = make_step(seed)
    settings = _settings(policy, mode, ["tis", "icepop", "seq_mask", "none"][seed % 4])
    everything = torch.arange(seq_ids.numel())
    whole = _loss_grads_metrics(step, seq_ids, seq_counts, counts, settings, [everything])

    # Random partition of the sequences (not contiguous) into 4 microbatches, one maybe empty.
    g = torch.Generator().manual_seed(1000 + seed)
    owner = torch.randint(0, 4, (int(seq_ids.max()) + 1,), generator=g)
    parts = [torch.nonzero(owner[seq_ids] == k).squeeze(1) for k in range(4)]
    split = _loss_grads_metrics(step, seq_ids, seq_counts, counts, settings, parts)
    _assert_same(whole, split)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@pytest.mark.parametrize("policy", ["ppo_clip", "cispo", "reinforce", "sft", "stable_reinforce"])
def test_sequences_sharded_over_ranks(policy, mode):
    """What context parallel relies on, for the token-local losses: split every sequence's
    tokens over two "ranks" (odd / even positions); with the global per-sequence counts the two
    shares sum to the whole. (Sequence-level terms need the CP all-reduce: distributed tests.)"""
    step, seq_ids, seq_counts, counts = make_step(seed=50 + AGGREGATION_MODES.index(mode))
    settings = _settings(policy, mode, "icepop")
    everything = torch.arange(seq_ids.numel())
    whole = _loss_grads_metrics(step, seq_ids, seq_counts, counts, settings, [everything])
    shards = [everything[everything % 2 == 0], everything[everything % 2 == 1]]
    split = _loss_grads_metrics(step, seq_ids, seq_counts, counts, settings, shards)
    _assert_same(whole, split)
