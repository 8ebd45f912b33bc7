"""The padded-tensor API (`unirl.losses`) on cases worked out by hand, and against the flat core
on a ragged packed batch laid out the way unirl's trainer lays it out.

The hand case used throughout (clip 0.2 / 0.2), B=2, L=3:

    row 0: ratios 0.5, 1.0, pad   A = +1, +1      row 1: ratio 1.5, pad, pad   A = -2
    ppo_clip per token: max(-A r, -A clip(r)):
        r=0.5 A=1 : max(-0.5, -0.8) = -0.5   (unclipped; d/dlogp = -A r = -0.5)
        r=1.0 A=1 : -1.0                     (d/dlogp = -1.0)
        r=1.5 A=-2: max(3.0, 2.4) = 3.0      (d/dlogp = -A r = 3.0)
"""

from __future__ import annotations

import math

import pytest
import torch

from unirl.core.data.counts import GlobalCounts
from unirl.core.errors import ConfigError, LossInputError
from unirl.core.maths.losses import LossInputs, LossSettings, compute_loss, reduce_metrics
from unirl.losses import advantages, kl_loss, policy_loss, value_loss

F64 = torch.float64
LOGP = [[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]]
RATIOS = [[0.5, 1.0, 1.0], [1.5, 1.0, 1.0]]
ADV = [[1.0, 1.0, 0.0], [-2.0, 0.0, 0.0]]
MASK = [[1, 1, 0], [1, 0, 0]]


def _case(nan_padding: bool = True):
    logp = torch.tensor(LOGP, dtype=F64, requires_grad=True)
    old = logp.detach() - torch.tensor(RATIOS, dtype=F64).log()
    if nan_padding:
        old[0, 2] = float("nan")  # an engine's unscored padding: must be ignored
    return logp, old, torch.tensor(ADV, dtype=F64), torch.tensor(MASK)


def _loss_grad(name="ppo_clip", **kwargs):
    logp, old, adv, mask = _case()
    loss, metrics = policy_loss(name, logp, old, adv, mask, **kwargs)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.item(), grad, metrics


def test_ppo_clip_token_mean_by_hand():
    loss, grad, metrics = _loss_grad()
    # (-0.5 - 1.0 + 3.0) / 3 valid tokens
    assert loss == pytest.approx(0.5)
    expected = torch.tensor([[-0.5, -1.0, 0.0], [3.0, 0.0, 0.0]], dtype=F64) / 3
    torch.testing.assert_close(grad, expected)
    assert isinstance(metrics["pg_clipfrac"], float)
    assert metrics["pg_clipfrac"] == 0.0 and metrics["loss"] == pytest.approx(0.5)
    # ppo_kl = mean(old - logp) = mean(-log r) = (log 2 + 0 - log 1.5) / 3
    assert metrics["ppo_kl"] == pytest.approx((math.log(2) - math.log(1.5)) / 3)


def test_seq_mean_token_mean_by_hand():
    settings = LossSettings(loss_aggregation="seq-mean-token-mean")
    loss, grad, _ = _loss_grad(settings=settings)
    # row 0: (-0.5 - 1.0) / 2 = -0.75; row 1: 3.0 / 1; mean over 2 sequences = 1.125
    assert loss == pytest.approx(1.125)
    expected = torch.tensor([[-0.5 / 4, -1.0 / 4, 0.0], [3.0 / 2, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(grad, expected)


def test_seq_mean_token_sum_norm_needs_and_uses_norm_length():
    settings = LossSettings(loss_aggregation="seq-mean-token-sum-norm")
    with pytest.raises(LossInputError, match="norm_length"):
        _loss_grad(settings=settings)
    loss, _, _ = _loss_grad(settings=settings, norm_length=4)
    assert loss == pytest.approx((-1.5 + 3.0) / (2 * 4))


def test_global_counts_divide_instead_of_the_batch_own():
    loss, grad, metrics = _loss_grad(global_tokens=6)
    assert loss == pytest.approx(1.5 / 6)  # this batch's share of a 6-token step
    torch.testing.assert_close(grad[1, 0], torch.tensor(3.0 / 6, dtype=F64))
    assert metrics["loss"] == pytest.approx(0.5)  # the metric is still this batch's own mean
    settings = LossSettings(loss_aggregation="seq-mean-token-mean")
    loss, _, _ = _loss_grad(settings=settings, global_sequences=torch.tensor(4))
    assert loss == pytest.approx(2.25 / 4)


def test_a_count_smaller_than_the_batch_own_is_refused():
    with pytest.raises(LossInputError, match="global_tokens=2 is smaller"):
        _loss_grad(global_tokens=2)
    with pytest.raises(LossInputError, match="global_sequences"):
        _loss_grad(global_sequences=1)


def test_empty_row_counts_no_sequence():
    logp, old, adv, mask = _case()
    pad = torch.zeros(1, 3, dtype=F64)
    logp3 = torch.cat([logp.detach(), pad]).requires_grad_()
    mask3 = torch.cat([mask, torch.zeros(1, 3, dtype=mask.dtype)])
    settings = LossSettings(loss_aggregation="seq-mean-token-mean")
    loss, _ = policy_loss(
        "ppo_clip", logp3, torch.cat([old, pad]), torch.cat([adv, pad]), mask3, settings=settings
    )
    assert loss.item() == pytest.approx(1.125)  # still / 2, the empty response is not a sequence


def test_dual_clip_by_hand():
    # row 1 ratio 4.0, A = -1: ppo loss max(4.0, 1.2) = 4.0; dual clip c=3: min(4.0, 3.0) = 3.0
    logp = torch.tensor([[-1.0, -1.0]], dtype=F64, requires_grad=True)
    old = logp.detach() - torch.tensor([[math.log(4.0), 0.0]], dtype=F64)
    adv = torch.tensor([-1.0], dtype=F64)  # [B]: one advantage per sequence
    settings = LossSettings(dual_clip=3.0)
    loss, metrics = policy_loss("ppo_clip", logp, old, adv, torch.ones(1, 2), settings=settings)
    (grad,) = torch.autograd.grad(loss, logp)
    # token 1: ratio 1, A=-1: loss 1.0, d/dlogp = 1.0; token 0 capped: no gradient
    assert loss.item() == pytest.approx((3.0 + 1.0) / 2)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.5]], dtype=F64))
    assert metrics["pg_clipfrac_lower"] == pytest.approx(0.5)


def test_cispo_by_hand():
    # weight = sg(clip(r, 1 - 1.0, 1 + 0.2)); loss = -w A logp; d/dlogp = -w A
    settings = LossSettings(clip_low=1.0, clip_high=0.2)
    loss, grad, metrics = _loss_grad("cispo", settings=settings)
    # row 0: -0.5*1*(-1) - 1*1*(-2) = 0.5 + 2 = 2.5; row 1: -1.2*(-2)*(-1) = -2.4
    assert loss == pytest.approx((2.5 - 2.4) / 3)
    expected = torch.tensor([[-0.5, -1.0, 0.0], [2.4, 0.0, 0.0]], dtype=F64) / 3
    torch.testing.assert_close(grad, expected)
    assert metrics["pg_clipfrac"] == pytest.approx(1 / 3)  # r=1.5 clipped to 1.2


def test_gspo_by_hand():
    # row 0: s = exp(mean(log 0.5, log 1)) = sqrt(0.5) = 0.7071, A=1: loss -0.7071 per token,
    # unclipped (clip(0.7071) = 0.8 gives -0.8 < -0.7071); row 1: s = 1.5, A=-2: max(3.0, 2.4)
    settings = LossSettings(loss_aggregation="seq-mean-token-mean")
    loss, grad, _ = _loss_grad("gspo", settings=settings)
    s0 = math.sqrt(0.5)
    assert loss == pytest.approx((-s0 + 3.0) / 2)
    # GSPO's gradient: -A s (1/|y|) per token, over 2 sequences
    expected = torch.tensor([[-s0 / 2 / 2, -s0 / 2 / 2, 0.0], [3.0 / 2, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(grad, expected)


def test_icepop_and_kl_and_entropy_terms_by_hand():
    logp, old, adv, mask = _case(nan_padding=False)
    # rollout log-probs: x = old - rollout = log 3 on token (0,0) -> outside [0.5, 2]: weight 0
    rollout = old.clone()
    rollout[0, 0] -= math.log(3.0)
    ref = logp.detach() - 1.0  # k1 = logp - ref = 1 on every token
    entropy = torch.full((2, 3), 2.0, dtype=F64)
    settings = LossSettings(
        rollout_correction="icepop", kl_loss_coef=0.1, kl_loss_estimator="k1", entropy_coef=0.01
    )
    loss, metrics = policy_loss(
        "ppo_clip",
        logp,
        old,
        adv,
        mask,
        settings=settings,
        rollout_logprobs=rollout,
        ref_logprobs=ref,
        entropy=entropy,
    )
    # pg: (0*(-0.5) - 1.0 + 3.0) = 2.0; kl: 0.1 * 3; entropy: -0.01 * 2 * 3 -> / 3 tokens
    assert loss.item() == pytest.approx((2.0 + 0.3 - 0.06) / 3)
    assert metrics["is_clipfrac"] == pytest.approx(1 / 3)
    assert metrics["kl"] == pytest.approx(1.0) and metrics["entropy"] == pytest.approx(2.0)


def test_is_weights_scale_the_policy_term_only():
    logp, old, adv, mask = _case()
    w = torch.tensor([[0.0, 2.0, 5.0], [0.5, 1.0, 1.0]], dtype=F64)
    loss, _ = policy_loss("ppo_clip", logp, old, adv, mask, is_weights=w)
    assert loss.item() == pytest.approx((0.0 - 2.0 + 1.5) / 3)


def test_on_policy_old_logprobs_none_gives_ratio_one():
    logp, _, adv, mask = _case()
    loss, _ = policy_loss("ppo_clip", logp, None, adv, mask)
    assert loss.item() == pytest.approx((-1.0 - 1.0 + 2.0) / 3)


def test_value_loss_by_hand():
    # token 0: (1.0 - 1.5)^2 = 0.25 both ways -> 0.125; token 1: (2.0 - 1.0)^2 = 1.0 vs clipped
    # value 1.5 + 0.2 = 1.7 -> 0.49: max 1.0 -> 0.5; token-mean (0.125 + 0.5) / 2
    values = torch.tensor([[1.0, 2.0, 9.0]], requires_grad=True)
    loss, metrics = value_loss(
        values,
        torch.tensor([[1.5, 1.0, 0.0]]),
        torch.tensor([[1, 1, 0]]),
        old_values=torch.tensor([[1.0, 1.5, 0.0]]),
    )
    assert loss.item() == pytest.approx(0.3125)
    assert metrics == pytest.approx({"value_loss": 0.3125, "vf_clipfrac": 0.0})
    (grad,) = torch.autograd.grad(loss, values)
    torch.testing.assert_close(grad, torch.tensor([[-0.25, 0.5, 0.0]]))  # (v - R) / 2 tokens


def test_kl_loss_by_hand():
    logp = torch.tensor([[-1.0, -3.0]])
    ref = torch.tensor([[-2.0, -3.0]])
    loss, metrics = kl_loss(logp, ref, torch.tensor([[1, 1]]), estimator="k3")
    # k3 = exp(ref - logp) - (ref - logp) - 1: token 0: e^-1 + 1 - 1 = 0.3679; token 1: 0
    assert loss.item() == pytest.approx(math.exp(-1) / 2)
    assert metrics["kl"] == pytest.approx(math.exp(-1) / 2)


def test_grpo_advantages_by_hand():
    adv, returns = advantages(
        "grpo",
        torch.tensor([1.0, 0.0, 3.0, 3.0]),
        torch.tensor([[1, 1], [1, 0], [1, 1], [0, 0]]),
        group_ids=torch.tensor([0, 0, 1, 1]),
    )
    # group 0: mean 0.5, unbiased std sqrt(0.5): +-0.5 / 0.7071; group 1: equal rewards -> 0
    a = 0.5 / math.sqrt(0.5)
    torch.testing.assert_close(
        adv, torch.tensor([[a, a], [-a, 0.0], [0.0, 0.0], [0.0, 0.0]]), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(returns[0], torch.tensor([1.0, 1.0]))


def test_reinforce_pp_token_rewards_are_whitened_over_the_batch():
    # token rewards [B, L]: return-to-go (gamma 1) row 0: [3, 2], row 1: [1, -]
    adv, _ = advantages(
        "reinforce_pp", torch.tensor([[1.0, 2.0], [1.0, 7.0]]), torch.tensor([[1, 1], [1, 0]])
    )
    g = torch.tensor([3.0, 2.0, 1.0])
    w = (g - g.mean()) / g.std()  # unbiased, as masked_whiten
    torch.testing.assert_close(adv[adv != 0], w[w != 0], atol=1e-4, rtol=0)
    assert adv[1, 1] == 0.0


def test_errors_name_the_argument():
    logp, old, adv, mask = _case()
    with pytest.raises(LossInputError, match="old_logprobs has shape"):
        policy_loss("ppo_clip", logp, old[:, :2], adv, mask)
    with pytest.raises(LossInputError, match=r"logprobs must be a torch\.Tensor"):
        policy_loss("ppo_clip", [[0.0]], old, adv, mask)
    with pytest.raises(LossInputError, match="mask must hold only 0 and 1"):
        policy_loss("ppo_clip", logp, old, adv, mask * 2)
    with pytest.raises(LossInputError, match="advantages has shape"):
        policy_loss("ppo_clip", logp, old, adv[:, :1], mask)
    with pytest.raises(ConfigError, match="ppo_clp"):
        policy_loss("ppo_clp", logp, old, adv, mask)
    with pytest.raises(ConfigError, match=r"settings\.policy_loss='cispo'"):
        policy_loss("gspo", logp, old, adv, mask, settings=LossSettings(policy_loss="cispo"))
    with pytest.raises(LossInputError, match="group_ids"):
        advantages("grpo", torch.ones(2), torch.ones(2, 3))


@pytest.mark.parametrize(
    "name, settings",
    [
        ("ppo_clip", dict(loss_aggregation="token-mean", clip_high=0.28, dual_clip=3.0)),
        ("gspo", dict(loss_aggregation="seq-mean-token-mean", clip_low=0.1, clip_high=0.1)),
        ("cispo", dict(loss_aggregation="seq-mean-token-sum", clip_low=1.0, clip_high=0.3)),
        ("reinforce", dict(loss_aggregation="seq-mean-token-sum-norm", rollout_correction="tis")),
        (
            "ppo_clip",
            dict(rollout_correction="seq_mask", kl_loss_coef=0.1, kl_loss_estimator="k3+"),
        ),
    ],
)
def test_equals_the_flat_core_on_a_packed_ragged_batch(name, settings):
    """The trainer's layout: each sequence's tokens packed one after another (prompt tokens
    masked, no padding), the plan's counts over TWO microbatches; the padded API gets the same
    rows right-padded and the same global counts."""
    g = torch.Generator().manual_seed(0)
    lengths, prompt = [5, 2, 7, 4], 2
    b, width = len(lengths), max(lengths)
    logp = -torch.rand(b, width, generator=g, dtype=F64) * 2
    old = logp + 0.3 * torch.randn(b, width, generator=g, dtype=F64)
    rollout = old + 0.3 * torch.randn(b, width, generator=g, dtype=F64)
    ref = logp + 0.2 * torch.randn(b, width, generator=g, dtype=F64)
    adv = torch.randn(b, generator=g, dtype=F64)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    other_mb_tokens, other_mb_seqs = 9, 2  # the step's other microbatch
    counts = GlobalCounts(
        tokens=int(mask.sum()) + other_mb_tokens, sequences=b + other_mb_seqs, norm_length=8
    )
    s = LossSettings(policy_loss=name, **settings)

    # flat: [prompt (masked), response] per sequence
    parts = {k: [] for k in ("logp", "old", "rollout", "ref", "adv", "mask", "ids")}
    for i, n in enumerate(lengths):
        parts["logp"] += [torch.zeros(prompt, dtype=F64), logp[i, :n]]
        for k, x in (("old", old), ("rollout", rollout), ("ref", ref)):
            parts[k] += [torch.zeros(prompt, dtype=F64), x[i, :n]]
        parts["adv"] += [torch.zeros(prompt, dtype=F64), adv[i].expand(n)]
        parts["mask"] += [torch.zeros(prompt), torch.ones(n)]
        parts["ids"] += [torch.full((prompt + n,), i)]
    flat_logp = torch.cat(parts["logp"]).requires_grad_()
    flat = compute_loss(
        LossInputs(
            logprobs=flat_logp,
            old_logprobs=torch.cat(parts["old"]),
            rollout_logprobs=torch.cat(parts["rollout"]),
            ref_logprobs=torch.cat(parts["ref"]),
            advantages=torch.cat(parts["adv"]),
            loss_mask=torch.cat(parts["mask"]),
            seq_ids=torch.cat(parts["ids"]),
            num_seqs=b,
            seq_token_counts=torch.tensor(lengths),
        ),
        counts,
        s,
    )
    (flat_grad,) = torch.autograd.grad(flat.loss, flat_logp)

    padded_logp = logp.clone().requires_grad_()
    loss, metrics = policy_loss(
        name,
        padded_logp,
        old,
        adv,
        mask,
        settings=s,
        rollout_logprobs=rollout,
        ref_logprobs=ref,
        global_tokens=counts.tokens,
        global_sequences=counts.sequences,
        norm_length=8,
    )
    (grad,) = torch.autograd.grad(loss, padded_logp)
    torch.testing.assert_close(loss, flat.loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad[mask], flat_grad[torch.cat(parts["mask"]).bool()])
    assert (grad[~mask] == 0).all()
    assert metrics == pytest.approx(reduce_metrics([flat.metrics]))


def test_readme_snippet_runs_as_written():
    from tests.unit.doc_snippets import doc_snippet

    scope: dict = {}
    exec(doc_snippet("guides/integrations.md", "padded"), scope)
    assert scope["logprobs"].grad is not None and set(scope["metrics"]) >= {"loss", "pg_clipfrac"}


def test_global_counts_of_one_batch_by_hand():
    from unirl.losses import global_counts

    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert global_counts(mask) == (3, 2)  # the empty row is no sequence
