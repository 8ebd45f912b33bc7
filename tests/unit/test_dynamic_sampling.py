"""DAPO's dynamic sampling (`unirl.rollouts.shaping.dynamic_sampling`) on the generating base: the groups
kept for a reward table written out by hand, the draws, the padding or the error when draws run
out, the metrics, a replaceable criterion, and the resume of the prompt stream after extra draws."""

from __future__ import annotations

import pytest
import torch

from unirl.core.config.sections.rollout_shaping import DynamicSamplingConfig
from unirl.core.errors import ConfigError, RunError
from unirl.rollouts.data.tasks import make_task
from unirl.rollouts.generating import GeneratingSource
from unirl.rollouts.sampler import Generation
from unirl.rollouts.shaping.dynamic_sampling import (
    GROUP_FILTERS,
    register_group_filter,
    varied_rewards,
)
from unirl.rollouts.shaping.settings import RolloutShaping


class TableSource(GeneratingSource):
    """Draw d's group g gets the rewards ``table[d][g]`` (one per sample); responses [1, 2]."""

    source_name = "table"

    def __init__(self, table, *, max_draws, on_exhausted="train", criterion="varied_rewards"):
        ds = DynamicSamplingConfig(
            enabled=True, max_draws=max_draws, on_exhausted=on_exhausted, criterion=criterion
        )
        super().__init__(
            make_task("reverse_digits"), prompts_per_rollout=len(table[0]),
            samples_per_prompt=len(table[0][0]), seed=5, vocab_size=64, policy_version=3,
            shaping=RolloutShaping(dynamic_sampling=ds),
        )  # fmt: skip
        self.table = table
        self.calls = 0

    def _generate_rollout(self, rl_step, problems, progress):
        gens = [
            Generation(
                response_tokens=torch.tensor([1, 2]), logprobs=torch.full((2,), -0.5), finished=True
            )
            for _ in range(len(problems) * self.samples_per_prompt)
        ]
        return self.build_batch(problems, gens, rl_step)

    def _score_once(self, problems, responses):
        rewards = [r for group in self.table[self.calls] for r in group]
        self.calls += 1
        return rewards


def _group_rewards(batch):
    out: dict[int, list[float]] = {}
    for s in batch.samples:
        out.setdefault(s.group_id, []).append(s.reward)
    return out


def test_the_default_criterion_on_a_reward_table():
    table = [[1, 1, 1], [0, 1, 0], [0, 0, 0], [0.5, 0.5, 0.25], [0.3]]
    # equal rewards teach nothing (all GRPO advantages 0): kept are rows 1 and 3 only
    assert [varied_rewards(r) for r in table] == [False, True, False, True, False]


def test_draws_until_full_and_drops_the_overflow():
    table = [
        [[1, 1], [0, 1]],  # draw 0: groups 0, 1 -> keep 1
        [[0, 0], [1, 1]],  # draw 1: groups 2, 3 -> keep none
        [[1, 0], [0, 1]],  # draw 2: groups 4, 5 -> keep 4 (full); 5 passes but is dropped
        [[1, 0], [0, 1]],  # never drawn
    ]
    source = TableSource(table, max_draws=4)
    batch = source.next_rollout(0)
    assert _group_rewards(batch) == {1: [0.0, 1.0], 4: [1.0, 0.0]}
    m = source.rollout_metrics()
    assert m["rollout/draws"] == 3 and m["rollout/groups_drawn"] == 6
    assert m["rollout/groups_kept"] == 3  # groups 1, 4, 5 passed
    assert m["rollout/groups_kept_fraction"] == pytest.approx(3 / 6)
    assert m["rollout/padding_groups"] == 0
    # every sample has 2 response tokens: groups 0, 2, 3 (draws 0, 1) and 5 (draw 2) discarded
    assert 0 < m["rollout/discarded_generation_fraction"] <= 1
    assert all(s.policy_version == 3 for s in batch.samples)
    assert source.state_dict()["draws"] == 3 and source.state_dict()["rollouts_drawn"] == 1
    assert source.draw_index == 3  # what a source seeds its next draw by (vLLM: sample_seed)


def test_exhausted_draws_train_on_the_kept_groups_padded_with_masked_ones():
    table = [[[1, 1], [0, 1]], [[0, 0], [1, 1]]]
    source = TableSource(table, max_draws=2, on_exhausted="train")
    batch = source.next_rollout(0)
    # kept: group 1; one group short: the newest filtered group (3) with its loss mask zero
    assert _group_rewards(batch) == {1: [0.0, 1.0], 3: [1.0, 1.0]}
    masks = [s.loss_mask.tolist() for s in batch.samples]
    assert masks == [[True, True], [True, True], [False, False], [False, False]]
    assert [bool(s.metadata.get("padding")) for s in batch.samples] == [False, False, True, True]
    assert source.rollout_metrics()["rollout/padding_groups"] == 1


def test_exhausted_draws_stop_with_a_named_error():
    table = [[[1, 1], [0, 1]], [[0, 0], [1, 1]]]
    source = TableSource(table, max_draws=2, on_exhausted="error")
    with pytest.raises(RunError, match=r"kept 1 of 4 groups in 2 draws.*max_draws \(now 2\)"):
        source.next_rollout(0)
    # no group kept: nothing to train, also under on_exhausted: train
    source = TableSource([[[1, 1], [0, 0]]], max_draws=1, on_exhausted="train")
    with pytest.raises(RunError, match="nothing to train"):
        source.next_rollout(0)


def test_a_registered_criterion_replaces_the_default():
    register_group_filter("any_solved", lambda rewards: max(rewards) >= 1.0)
    try:
        source = TableSource(
            [[[1, 1], [0, 0]], [[0, 1], [0, 0]]], max_draws=2, criterion="any_solved"
        )
        assert _group_rewards(source.next_rollout(0)) == {0: [1.0, 1.0], 2: [0.0, 1.0]}
    finally:
        GROUP_FILTERS._entries.pop("any_solved")
    with pytest.raises(ConfigError, match="any_solved"):
        GROUP_FILTERS.get("any_solved")


class DigitSource(GeneratingSource):
    """Rewards from the prompt itself (a group is varied when its prompt's digit sum is odd), so
    a resumed source must draw the same prompts to make the same rollouts."""

    source_name = "digits"

    def _generate_rollout(self, rl_step, problems, progress):
        gens = [
            Generation(response_tokens=torch.tensor([1]), logprobs=torch.zeros(1), finished=True)
            for _ in range(len(problems) * self.samples_per_prompt)
        ]
        return self.build_batch(problems, gens, rl_step)

    def _score_once(self, problems, responses):
        out = []
        for i, p in enumerate(problems):
            odd = sum(int(c) for c in p.prompt_text if c.isdigit()) % 2
            out.append(float(i % 2) if odd else 1.0)
        return out


def _digits(seed):
    ds = DynamicSamplingConfig(enabled=True, max_draws=8)
    return DigitSource(
        make_task("reverse_digits"), prompts_per_rollout=3, samples_per_prompt=2, seed=seed,
        vocab_size=64, policy_version=0, shaping=RolloutShaping(dynamic_sampling=ds),
    )  # fmt: skip


def _key(batch):
    return [(s.group_id, s.prompt_tokens.tolist(), s.reward) for s in batch.samples]


def test_resume_after_extra_draws_continues_the_stream_exactly():
    straight = _digits(1)
    rollouts = [_key(straight.next_rollout(k)) for k in range(3)]
    first = _digits(1)
    first.next_rollout(0)
    state = first.state_dict()
    assert state["draws"] > state["rollouts_drawn"] == 1  # some groups were uniform
    resumed = _digits(77)  # another seed: the state alone must set the stream
    resumed.load_state_dict(state)
    assert [_key(resumed.next_rollout(k)) for k in (1, 2)] == rollouts[1:]


def test_padding_passes_the_rollout_check_also_with_per_token_rewards():
    """An episode's padding group: its per-token rewards go with its loss mask (the rollout
    check refuses a reward on an untrained token), and the batch still validates."""
    from unirl.core.data.rollout import RolloutBatch, RolloutSample
    from unirl.rollouts.shaping.dynamic_sampling import _masked

    kept = RolloutSample(
        prompt_tokens=[1], response_tokens=[2, 3], reward=1.0, group_id=0,
        token_rewards=torch.tensor([0.0, 1.0]),
    )  # fmt: skip
    episode = RolloutSample(
        prompt_tokens=[1], response_tokens=[2, 3], reward=1.0, group_id=1,
        token_rewards=torch.tensor([0.0, 1.0]),
    )  # fmt: skip
    (pad,) = _masked([episode])
    assert pad.token_rewards.tolist() == [0.0, 0.0] and pad.loss_mask.tolist() == [False, False]
    RolloutBatch((kept, pad)).validate(vocab_size=8, max_seq_len=8, samples_per_prompt=1)


def test_the_generation_bar_expects_every_draw(caplog):
    """Each further draw of a rollout tells the bar its samples: no miscount warning, and the bar
    counts every generated sample (3 draws of 2 x 2 samples = 12, also on the second rollout)."""
    import logging

    from unirl.core.progress.bars import GenerationProgress
    from unirl.core.topology import Topology

    class Counting(TableSource):
        def _generate_rollout(self, rl_step, problems, progress):
            batch = super()._generate_rollout(rl_step, problems, progress)
            progress.update(samples=len(batch), tokens=2 * len(batch))
            return batch

    draw = [[[1, 1], [0, 1]], [[0, 0], [1, 1]], [[1, 0], [0, 1]]]
    source = Counting(draw + draw, max_draws=4)
    caplog.set_level(logging.WARNING)
    for step in range(2):
        with GenerationProgress("generate", 4, Topology(), enabled=False) as bar:
            source.next_rollout(step, progress=bar)
        assert bar.count == bar.total == 12
    assert not [r for r in caplog.records if "counted" in r.getMessage()]
