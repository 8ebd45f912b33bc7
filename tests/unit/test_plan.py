"""The microbatch plan: hand-worked layouts, config errors, and a property test that every
sample lands exactly once, ranks agree on the microbatch count, budgets hold, loads balance and
the global counts equal a plain sum."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unirl.core.data.counts import GlobalCounts
from unirl.core.data.plan import MicrobatchPlan, _split_to
from unirl.core.errors import ConfigError


def test_count_mode_hand_worked() -> None:
    lengths = [10, 1, 2, 9, 3, 8, 4, 7]
    valid = [5, 0, 1, 4, 2, 3, 1, 6]
    plan = MicrobatchPlan.build(
        lengths, valid, num_optimizer_steps=1, dp_size=2, micro_batch_size=2, norm_length=64
    )
    # longest first: 0(10) 3(9) 5(8) 7(7) 6(4) 4(3) 2(2) 1(1), rounds of two:
    #   round 1, loads 0/0:   0 -> r0 (10), 3 -> r1 (9)
    #   round 2, r1 lighter:  5 -> r1 (17), 7 -> r0 (17)
    #   round 3, tie -> r0:   6 -> r0 (21), 4 -> r1 (20)
    #   round 4, r1 lighter:  2 -> r1 (22), 1 -> r0 (22)
    # r0 = {0, 7, 6, 1} into 2 microbatches: 0 -> m0 (10), 7 -> m1 (7); 6 -> m1 (11), 1 -> m0 (11)
    # r1 = {3, 5, 4, 2}: 3 -> m0 (9), 5 -> m1 (8); 4 -> m1 (11), 2 -> m0 (11)
    step = plan.steps[0]
    assert step.microbatches(0) == [(0, 1), (6, 7)]
    assert step.microbatches(1) == [(2, 3), (4, 5)]
    assert step.rank_microbatch_tokens == ((11, 11), (11, 11))
    # tokens 5+0+1+4+2+3+1+6 = 22; sequences: all but sample 1 (no valid token) = 7
    assert step.counts == GlobalCounts(tokens=22, sequences=7, norm_length=64)
    assert plan.num_microbatches == (2,)
    with pytest.raises(ConfigError, match="dp_rank=2"):
        step.microbatches(2)


def test_count_mode_two_steps_keep_batch_order() -> None:
    lengths = [3, 1, 4, 1, 5, 9, 2, 6]
    valid = [1, 1, 2, 0, 3, 4, 2, 1]
    plan = MicrobatchPlan.build(
        lengths, valid, num_optimizer_steps=2, dp_size=2, micro_batch_size=1
    )
    # step 0 = samples 0..3 (3, 1, 4, 1): 2(4) -> r0, 0(3) -> r1; r1 lighter: 1 -> r1, 3 -> r0
    assert plan.steps[0].microbatches(0) == [(2,), (3,)]
    assert plan.steps[0].microbatches(1) == [(0,), (1,)]
    # step 1 = samples 4..7 (5, 9, 2, 6): 5(9) -> r0, 7(6) -> r1; r1 lighter: 4 -> r1, 6 -> r0
    assert plan.steps[1].microbatches(0) == [(5,), (6,)]
    assert plan.steps[1].microbatches(1) == [(7,), (4,)]  # heaviest microbatch first
    # step 0: 1+1+2+0 = 4 tokens, 3 sequences; step 1: 3+4+2+1 = 10 tokens, 4 sequences
    assert plan.steps[0].counts == GlobalCounts(tokens=4, sequences=3)
    assert plan.steps[1].counts == GlobalCounts(tokens=10, sequences=4)


def test_token_mode_hand_worked() -> None:
    lengths = [6, 5, 4, 3, 2, 2]
    plan = MicrobatchPlan.build(
        lengths, [1] * 6, num_optimizer_steps=1, dp_size=2, max_tokens_per_microbatch=8
    )
    # ranks, longest to least loaded: 0 -> r0 (6), 1 -> r1 (5), 2 -> r1 (9), 3 -> r0 (9),
    #   4 -> r0 (11, tie to r0), 5 -> r1 (11)
    # first fit decreasing, budget 8: r0 {6, 3, 2} -> [6+2], [3]; r1 {5, 4, 2} -> [5+2], [4]
    # both need 2, spread longest first within 8: r0 -> {0}=6, {3,4}=5; r1 -> {1}=5, {2,5}=6
    step = plan.steps[0]
    assert step.microbatches(0) == [(0,), (3, 4)]
    assert step.microbatches(1) == [(2, 5), (1,)]
    assert step.rank_microbatch_tokens == ((6, 5), (6, 5))


def test_token_mode_keeps_first_fit_bins_when_spreading_breaks_the_budget() -> None:
    # budget 9: first fit decreasing gives [5+4], [3+3+3]; spreading longest-first over two
    # microbatches would give 5 | 4, 3 -> 5+3 | 7, then the last 3 fits nowhere (8+3, 7+3 > 9)
    plan = MicrobatchPlan.build(
        [5, 4, 3, 3, 3], [1] * 5, num_optimizer_steps=1, dp_size=1, max_tokens_per_microbatch=9
    )
    assert plan.steps[0].microbatches(0) == [(0, 1), (2, 3, 4)]


def test_token_mode_rank_with_fewer_samples_gets_an_empty_microbatch() -> None:
    # ranks: 0 -> r0 (10), 1 -> r1 (4), 2 -> r1 (8), 3 -> r1 (12); r1 needs 2 microbatches of
    # <= 10 tokens, so r0 (one sample) gets its sample and one empty microbatch
    plan = MicrobatchPlan.build(
        [10, 4, 4, 4], [1] * 4, num_optimizer_steps=1, dp_size=2, max_tokens_per_microbatch=10
    )
    assert plan.steps[0].microbatches(0) == [(0,), ()]
    assert plan.steps[0].microbatches(1) == [(1, 3), (2,)]
    assert plan.describe()["steps"][0]["empty_microbatches"] == 1


def test_split_to_splits_heaviest_then_pads() -> None:
    lengths = [5, 5, 1, 1, 7]
    # heaviest bin with two samples is {0, 1} (10): split into {0}, {1}; then no bin has two
    # samples left except {2, 3} (2), which splits next
    assert _split_to([[0, 1], [2, 3], [4]], lengths, 4) == [[2, 3], [4], [0], [1]]
    assert _split_to([[0, 1], [2, 3], [4]], lengths, 5) == [[4], [0], [1], [2], [3]]
    assert _split_to([[4]], lengths, 3) == [[4], [], []]


def test_shuffle_is_deterministic_and_keeps_groups_together() -> None:
    group_ids = [0, 0, 1, 1, 2, 2, 3, 3]
    kwargs = dict(num_optimizer_steps=4, dp_size=1, micro_batch_size=2, shuffle_seed=11)
    a = MicrobatchPlan.build([5] * 8, [1] * 8, group_ids=group_ids, **kwargs)
    b = MicrobatchPlan.build([5] * 8, [1] * 8, group_ids=group_ids, **kwargs)
    assert a == b
    assert sorted(a.order) == list(range(8))
    for step in a.steps:  # one whole group per step
        assert len({group_ids[i] for i in step.sample_indices}) == 1
    orders = {
        MicrobatchPlan.build(
            [5] * 8, [1] * 8, group_ids=group_ids, **{**kwargs, "shuffle_seed": s}
        ).order
        for s in range(6)
    }
    assert len(orders) > 1  # the seed matters


@pytest.mark.parametrize(
    ("n", "kwargs", "words"),
    [
        (
            10,
            dict(num_optimizer_steps=3, dp_size=1, micro_batch_size=1),
            "batch.samples_per_optimizer_step",
        ),
        (
            12,
            dict(num_optimizer_steps=2, dp_size=4, micro_batch_size=1),
            "batch.samples_per_optimizer_step=6 is not divisible by the data-parallel size 4",
        ),
        (
            12,
            dict(num_optimizer_steps=1, dp_size=2, micro_batch_size=4),
            "not divisible by batch.micro_batch_size x data-parallel size = 4 x 2",
        ),
        (4, dict(num_optimizer_steps=1, dp_size=1), "set exactly one of batch.micro_batch_size"),
        (
            4,
            dict(num_optimizer_steps=1, dp_size=1, micro_batch_size=1, max_tokens_per_microbatch=9),
            "set exactly one",
        ),
        (
            4,
            dict(num_optimizer_steps=1, dp_size=1, max_tokens_per_microbatch=6),
            "sample 0 has 7 tokens (prompt + response), more than batch.max_tokens_per_microbatch=6; "
            "raise max_tokens_per_microbatch to at least 7",
        ),
        (
            4,
            dict(num_optimizer_steps=2, dp_size=4, max_tokens_per_microbatch=100),
            "smaller than the data-parallel size 4",
        ),
    ],
)
def test_config_errors(n, kwargs, words) -> None:
    lengths = [7] + [3] * (n - 1)
    with pytest.raises(ConfigError) as info:
        MicrobatchPlan.build(lengths, [1] * n, **kwargs)
    assert words in str(info.value)


def test_bad_lengths() -> None:
    with pytest.raises(ConfigError, match="sample 1: sequence length 4 and valid token count 5"):
        MicrobatchPlan.build([3, 4], [1, 5], num_optimizer_steps=1, dp_size=1, micro_batch_size=1)
    with pytest.raises(ConfigError, match="2 sequence_lengths but 1 valid_token_counts"):
        MicrobatchPlan.build([3, 4], [1], num_optimizer_steps=1, dp_size=1, micro_batch_size=1)


# -- property test -------------------------------------------------------------------------


@st.composite
def plan_inputs(draw):
    steps = draw(st.integers(1, 3))
    dp = draw(st.integers(1, 4))
    count_mode = draw(st.booleans())
    if count_mode:
        mbs = draw(st.integers(1, 3))
        per_rank = mbs * draw(st.integers(1, 3))
        n = steps * dp * per_rank
    else:
        n = steps * draw(st.integers(dp, 3 * dp + 4))
    lengths = draw(st.lists(st.integers(1, 50), min_size=n, max_size=n))
    valid = [draw(st.integers(0, length)) for length in lengths]
    kwargs = dict(num_optimizer_steps=steps, dp_size=dp)
    if count_mode:
        kwargs["micro_batch_size"] = mbs
    else:
        kwargs["max_tokens_per_microbatch"] = draw(st.integers(max(lengths), max(lengths) * 4))
    if draw(st.booleans()):
        kwargs["shuffle_seed"] = draw(st.integers(0, 1000))
    return lengths, valid, kwargs


@settings(max_examples=60, deadline=None)
@given(plan_inputs())
def test_plan_properties(inputs) -> None:
    lengths, valid, kwargs = inputs
    plan = MicrobatchPlan.build(lengths, valid, norm_length=17, **kwargs)
    dp, steps = kwargs["dp_size"], kwargs["num_optimizer_steps"]
    per_step = len(lengths) // steps
    assert len(plan.steps) == steps
    seen = []
    for k, step in enumerate(plan.steps):
        rank_mbs = [step.microbatches(r) for r in range(dp)]
        # the same microbatch count on every rank
        assert {len(mbs) for mbs in rank_mbs} == {step.num_microbatches}
        members = [i for mbs in rank_mbs for mb in mbs for i in mb]
        seen += members
        # the step is a contiguous slice of the (shuffled) order
        assert sorted(members) == sorted(plan.order[k * per_step : (k + 1) * per_step])
        # global counts: a plain sum over the step's samples
        tokens = 0
        sequences = 0
        for i in members:
            tokens += valid[i]
            sequences += 1 if valid[i] > 0 else 0
        assert step.counts == GlobalCounts(tokens=tokens, sequences=sequences, norm_length=17)
        loads = []
        for r, mbs in enumerate(rank_mbs):
            mb_tokens = [sum(lengths[i] for i in mb) for mb in mbs]
            assert list(step.rank_microbatch_tokens[r]) == mb_tokens
            loads.append(sum(mb_tokens))
            n_rank = sum(len(mb) for mb in mbs)
            for mb in mbs:
                if kwargs.get("micro_batch_size"):
                    assert len(mb) == kwargs["micro_batch_size"]
                else:
                    assert sum(lengths[i] for i in mb) <= kwargs["max_tokens_per_microbatch"]
                    # an empty microbatch only on a rank with fewer samples than microbatches
                    assert mb or n_rank < step.num_microbatches
        # balance across ranks: within the longest sample of the step
        assert max(loads) - min(loads) <= max(lengths[i] for i in members)
    # every sample in exactly one microbatch of one rank of one step
    assert sorted(seen) == list(range(len(lengths)))
    if "shuffle_seed" not in kwargs:
        assert plan.order == tuple(range(len(lengths)))
    # every rank computes the same plan from the same inputs
    assert MicrobatchPlan.build(lengths, valid, norm_length=17, **kwargs) == plan
