"""The padded API gives what unirl's trainer computes: the same rollout run through the trainer's
own path (`RolloutBatch` -> `MicrobatchPlan` over 2 data-parallel ranks -> `build_microbatch` ->
`compute_loss` per microbatch with the plan's counts, as `unirl.core.step` does) sums to the
padded call's loss and gradient, and the advantages match `compute_advantages` as the step calls
it."""

from __future__ import annotations

import pytest
import torch

from unirl.core.data.context_parallel import shift_to_next_token
from unirl.core.data.microbatch import build_microbatch
from unirl.core.data.plan import MicrobatchPlan
from unirl.core.data.rollout import RolloutBatch
from unirl.core.maths.advantages import AdvantageInputs, AdvantageSettings, compute_advantages
from unirl.core.maths.losses import LossInputs, LossSettings, compute_loss
from unirl.losses import advantages, policy_loss

RESPONSES = [[3, 4, 5, 6, 7], [4, 5], [5, 6, 7, 3], [6], [7, 3, 4], [3, 3, 3, 4, 5, 6]]
LOSS_MASKS = [None, None, [1, 0, 1, 1], None, [0, 1, 1], None]  # 0: a tool's output token


def _batch() -> RolloutBatch:
    records = []
    for i, (resp, lm) in enumerate(zip(RESPONSES, LOSS_MASKS)):
        record = {
            "prompt_tokens": [1, 2 + i % 2],
            "response_tokens": resp,
            "reward": float((i * 7) % 3),
            "group_id": i // 3,
        }
        if lm is not None:
            record["loss_mask"] = lm
        records.append(record)
    return RolloutBatch.from_records(records)


@pytest.mark.parametrize(
    "settings",
    [
        LossSettings(clip_low=0.2, clip_high=0.28, dual_clip=3.0),
        LossSettings(policy_loss="gspo", loss_aggregation="seq-mean-token-mean", clip_low=0.05),
        LossSettings(policy_loss="cispo", loss_aggregation="seq-mean-token-sum-norm", clip_low=1.0),
    ],
    ids=["ppo_clip", "gspo", "cispo"],
)
def test_padded_call_equals_the_trainer_path(settings):
    batch = _batch()
    padded = batch.padded_responses()
    mask = padded.loss_mask & padded.mask
    g = torch.Generator().manual_seed(0)
    logp_bl = (-torch.rand(mask.shape, generator=g, dtype=torch.float64)).requires_grad_()
    old_bl = logp_bl.detach() + 0.4 * torch.randn(mask.shape, generator=g, dtype=torch.float64)

    # advantages: as RLStep.run calls compute_advantages
    trainer_adv = compute_advantages(
        AdvantageInputs(
            rewards=batch.rewards.to(torch.float32),
            group_ids=batch.group_ids,
            response_mask=padded.loss_mask.to(torch.float32) * padded.mask,
        ),
        AdvantageSettings(),
    ).advantages
    adv_bl, _ = advantages("grpo", batch.rewards.to(torch.float32), mask, group_ids=batch.group_ids)
    torch.testing.assert_close(adv_bl, trainer_adv, rtol=0, atol=0)

    # loss: as RLStep._optimizer_step builds each microbatch, on both data-parallel ranks
    plan = MicrobatchPlan.build(
        batch.lengths.tolist(),
        batch.valid_token_counts.tolist(),
        num_optimizer_steps=1,
        dp_size=2,
        micro_batch_size=1,
        norm_length=8,
    )
    (step,) = plan.steps
    total = torch.zeros((), dtype=torch.float64)
    for rank in range(2):
        for idx in step.microbatches(rank):
            packed = batch.pack(idx)
            mb = build_microbatch(
                packed,
                advantages=packed.place_responses(adv_bl.to(torch.float64)),
                old_logprobs=packed.place_responses(old_bl),
            )
            # the training forward's log-probs sit at the logit positions (shifted by one)
            logp_t = shift_to_next_token(
                packed.place_responses(logp_bl), packed.cu_seqlens.to(torch.long)
            )
            out = compute_loss(
                LossInputs(
                    logprobs=logp_t,
                    old_logprobs=mb.old_logprobs,
                    advantages=mb.advantages,
                    loss_mask=mb.loss_mask,
                    seq_ids=mb.seq_ids,
                    num_seqs=mb.num_seqs,
                    seq_token_counts=mb.seq_token_counts,
                ),
                step.counts,
                settings,
            )
            total = total + out.loss
    (trainer_grad,) = torch.autograd.grad(total, logp_bl)

    loss, _ = policy_loss(
        settings.policy_loss, logp_bl, old_bl, adv_bl, mask, settings=settings, norm_length=8
    )
    (grad,) = torch.autograd.grad(loss, logp_bl)
    assert step.counts.tokens == int(mask.sum()) and step.counts.sequences == len(RESPONSES)
    torch.testing.assert_close(loss, total, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, trainer_grad, rtol=1e-12, atol=1e-12)
    assert grad.abs().max() > 0
