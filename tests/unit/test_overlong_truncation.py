"""DAPO's soft overlong punishment (`unirl.rollouts.shaping.overlong`) at hand-computed lengths, added
once to the task reward where the rollout is built; and the truncation mask
(`unirl.core.data.truncation`): a cut sample's zero contribution to the loss and the step's counts,
against a per-sample Python loop."""

from __future__ import annotations

import pytest
import torch

from unirl.core.config.sections.rollout_shaping import OverlongConfig
from unirl.core.data.counts import GlobalCounts
from unirl.core.data.plan import MicrobatchPlan
from unirl.core.data.rollout import RolloutBatch, RolloutSample
from unirl.core.data.truncation import mask_truncated
from unirl.core.errors import ConfigError, RolloutDataError
from unirl.core.maths.losses import LossInputs, LossSettings, compute_loss
from unirl.rollouts.data.tasks import make_task
from unirl.rollouts.generating import GeneratingSource
from unirl.rollouts.sampler import Generation
from unirl.rollouts.shaping.overlong import overlong_penalty
from unirl.rollouts.shaping.settings import RolloutShaping, overlong_metrics

# L_max = 20, L_cache = 4: free up to 16 tokens, then -(|y| - 16) / 4 * factor, -factor past 20
CASES = [(1, 0.0), (16, 0.0), (17, -0.125), (18, -0.25), (19, -0.375), (20, -0.5), (21, -0.5)]


@pytest.mark.parametrize(("length", "penalty"), CASES)
def test_overlong_penalty_inside_at_the_edges_and_past_the_buffer(length, penalty):
    cfg = OverlongConfig(buffer_tokens=4, penalty_factor=0.5)
    assert overlong_penalty(length, max_new_tokens=20, config=cfg) == pytest.approx(penalty)


def test_overlong_penalty_off_and_a_buffer_of_the_whole_budget():
    assert overlong_penalty(20, max_new_tokens=20, config=OverlongConfig()) == 0.0
    whole = OverlongConfig(buffer_tokens=4)  # penalty from the first token: -(|y|) / 4
    assert overlong_penalty(1, max_new_tokens=4, config=whole) == pytest.approx(-0.25)
    assert overlong_penalty(0, max_new_tokens=4, config=whole) == 0.0


class LengthSource(GeneratingSource):
    """Group g's sample j answers with ``lengths[j]`` tokens, task reward 1.0."""

    source_name = "lengths"
    lengths = (2, 6, 8)

    def _generate_rollout(self, rl_step, problems, progress):
        gens = [
            Generation(response_tokens=torch.ones(n, dtype=torch.long), logprobs=torch.zeros(n),
                       finished=n < 8)
            for _ in problems for n in self.lengths
        ]  # fmt: skip
        return self.build_batch(problems, gens, rl_step)

    def _score_once(self, problems, responses):
        return [1.0] * len(responses)


def test_the_penalty_is_added_once_to_the_task_reward_and_logged_beside_it():
    shaping = RolloutShaping(
        overlong=OverlongConfig(buffer_tokens=4, penalty_factor=1.0), max_new_tokens=8
    )
    source = LengthSource(
        make_task("reverse_digits"), prompts_per_rollout=1, samples_per_prompt=3, seed=0,
        vocab_size=64, policy_version=0, shaping=shaping,
    )  # fmt: skip
    batch = source.next_rollout(0)
    # lengths 2, 6, 8 with L_max 8, L_cache 4: penalties 0, -(6-4)/4 = -0.5, -1
    assert [s.reward for s in batch.samples] == pytest.approx([1.0, 0.5, 0.0])
    assert [s.metadata["task_reward"] for s in batch.samples] == [1.0, 1.0, 1.0]
    m = source.rollout_metrics()
    assert m["reward/overlong_penalty"] == pytest.approx(-0.5)
    assert m["reward/task_mean"] == pytest.approx(1.0)
    assert overlong_metrics(batch) == {k: v for k, v in m.items() if k != "time/verify_s"}


def test_the_buffer_must_fit_the_budget():
    from unirl.core.config.sections.rollout import RolloutConfig

    with pytest.raises(ConfigError, match=r"rollout.overlong.buffer_tokens=9.*max_new_tokens=8"):
        RolloutConfig(max_new_tokens=8, overlong=OverlongConfig(buffer_tokens=9))


def _sample(n, finished, adv_group):
    return RolloutSample(
        prompt_tokens=[1, 2], response_tokens=list(range(3, 3 + n)), reward=1.0,
        group_id=adv_group, metadata={"finished": finished},
    )  # fmt: skip


def test_a_cut_sample_contributes_nothing_and_leaves_the_counts():
    batch = RolloutBatch((_sample(3, True, 0), _sample(4, False, 0), _sample(2, True, 1)))
    masked, cut = mask_truncated(batch)
    assert cut == 1
    assert [int(s.loss_mask.sum()) for s in masked.samples] == [3, 0, 2]
    plan = MicrobatchPlan.build(
        masked.lengths.tolist(), masked.valid_token_counts.tolist(), num_optimizer_steps=1,
        dp_size=1, micro_batch_size=3,
    )  # fmt: skip
    # the per-sample loop: tokens and sequences of the finished samples only
    finished = [s for s in batch.samples if s.metadata["finished"]]
    tokens, sequences = sum(s.response_length for s in finished), len(finished)
    assert plan.steps[0].counts == GlobalCounts(tokens=tokens, sequences=sequences)

    # the loss: ratio 1, advantage a_i per sample; token-mean = -sum(a over finished tokens) / 5
    adv = [0.5, 2.0, -1.0]
    lengths = [s.response_length for s in masked.samples]
    logp = torch.zeros(sum(lengths), dtype=torch.float64, requires_grad=True)
    mask = torch.cat([s.loss_mask for s in masked.samples])
    seq_ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    inputs = LossInputs(
        logprobs=logp, old_logprobs=logp.detach().clone(),
        advantages=torch.tensor([adv[i] for i in seq_ids.tolist()], dtype=torch.float64),
        loss_mask=mask, seq_ids=seq_ids, num_seqs=3,
        seq_token_counts=torch.zeros(3, dtype=torch.long).index_add(0, seq_ids, mask.long()),
    )  # fmt: skip
    out = compute_loss(inputs, plan.steps[0].counts, LossSettings())
    expected = -sum(
        a * s.response_length for a, s in zip(adv, batch.samples) if s.metadata["finished"]
    )
    assert out.loss.item() == pytest.approx(expected / tokens)
    (grad,) = torch.autograd.grad(out.loss, logp)
    assert grad[3:7].abs().sum().item() == 0.0  # the cut sample's 4 tokens: no gradient
    assert grad[:3].tolist() == pytest.approx([-0.5 / tokens] * 3)


def test_a_sample_that_does_not_say_whether_it_was_cut_is_refused():
    s = RolloutSample(prompt_tokens=[1], response_tokens=[2], reward=0.0, group_id=0)
    with pytest.raises(RolloutDataError, match=r"sample 0: algorithm.mask_truncated needs"):
        mask_truncated(RolloutBatch((s,)))
