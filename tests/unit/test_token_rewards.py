"""``token_rewards``: where in a response parts of its reward were earned (a multi-turn episode's
per-turn rewards on each turn's last token). Validated like the other per-token fields, read from
JSONL and Parquet, given to the token-level estimators (reinforce_pp, gae) as per-token rewards
with the rest of the reward as the outcome, and ignored by the sequence-level ones (the reward is
the total). Checked against a hand-built episode and a per-token GAE loop written here."""

import pytest
import torch

from unirl.core.data.rollout import RolloutBatch, RolloutSample
from unirl.core.data.rollout_io import read_rollouts, write_rollouts
from unirl.core.errors import RolloutDataError
from unirl.core.maths.advantages import (
    AdvantageInputs,
    AdvantageSettings,
    compute_advantages,
    rewards_for_estimator,
)
from unirl.rollouts.source import FileRolloutSource

# A hand-built episode: turn 0 = response 0-1 (a tool call, reward 0.2 on token 1), observation
# = 2-3 (mask 0, no rollout log-prob), turn 1 = 4-5 (the answer, reward 0.8 on token 5).
EPISODE = {
    "prompt_tokens": [1, 3],
    "response_tokens": [5, 6, 7, 8, 9, 2],
    "reward": 1.0,
    "group_id": 0,
    "loss_mask": [1, 1, 0, 0, 1, 1],
    "rollout_logprobs": [-0.1, -0.2, 0.0, 0.0, -0.3, -0.4],
    "token_rewards": [0.0, 0.2, 0.0, 0.0, 0.0, 0.8],
}
# A single-turn sample: no token rewards, its whole reward is the outcome.
SINGLE = {
    "prompt_tokens": [1, 4],
    "response_tokens": [6, 2],
    "reward": 0.5,
    "group_id": 0,
    "rollout_logprobs": [-0.5, -0.6],
    "token_rewards": [0.0, 0.0],
}


def _batch(*records):
    batch = RolloutBatch.from_records(list(records))
    batch.validate(vocab_size=16, max_seq_len=16, samples_per_prompt=len(records))
    return batch


def test_token_rewards_round_trip_jsonl_and_parquet(tmp_path):
    batch = _batch(EPISODE, SINGLE)
    assert batch.samples[0].token_rewards.dtype == torch.float32
    write_rollouts(tmp_path / "r.jsonl", batch)
    again = read_rollouts(tmp_path / "r.jsonl")
    assert again.samples[0].token_rewards.tolist() == pytest.approx(EPISODE["token_rewards"])
    assert again.samples == batch.samples
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed (Parquet is optional)")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([EPISODE, SINGLE]), tmp_path / "r.parquet")
    read = FileRolloutSource(tmp_path / "r.parquet", rollout_size=2).next_rollout(0)
    assert read.samples[0].token_rewards.tolist() == pytest.approx(EPISODE["token_rewards"])


def test_token_rewards_errors_name_sample_and_field():
    with pytest.raises(RolloutDataError, match=r"field 'token_rewards' element 1 is str"):
        RolloutSample.from_record({**EPISODE, "token_rewards": [0.0, "x", 0, 0, 0, 0]})
    with pytest.raises(RolloutDataError, match=r"sample 0: field 'token_rewards' has 5 values"):
        _batch({**EPISODE, "token_rewards": [0.0] * 5}, SINGLE)
    with pytest.raises(RolloutDataError, match=r"sample 0: field 'token_rewards' has nan"):
        _batch({**EPISODE, "token_rewards": [0, 0, float("nan"), 0, 0, 0]}, SINGLE)
    # a reward on an observation token would be dropped without a word by every estimator
    with pytest.raises(RolloutDataError, match=r"'token_rewards' has 0.5 at position 2, where"):
        _batch({**EPISODE, "token_rewards": [0, 0, 0.5, 0, 0, 0.5]}, SINGLE)
    with pytest.raises(RolloutDataError, match=r"sample 1: field 'token_rewards' is missing"):
        _batch(EPISODE, {k: v for k, v in SINGLE.items() if k != "token_rewards"})


def _inputs(batch, estimator, values=None):
    padded = batch.padded_responses()
    rewards, token_rewards = rewards_for_estimator(batch.rewards, padded.token_rewards, estimator)
    return AdvantageInputs(
        rewards=rewards,
        group_ids=batch.group_ids,
        response_mask=padded.loss_mask & padded.mask,
        token_rewards=token_rewards,
        values=values,
        old_logprobs=padded.rollout_logprobs,
    )


def _gae_loop(rewards, values, mask, gamma, lam):
    """Per-token GAE over the trained tokens of one response, the response end terminal."""
    valid = [t for t in range(len(mask)) if mask[t]]
    adv = [0.0] * len(mask)
    next_value, next_adv = 0.0, 0.0
    for t in reversed(valid):
        delta = rewards[t] + gamma * next_value - values[t]
        next_adv = delta + gamma * lam * next_adv
        adv[t], next_value = next_adv, values[t]
    return adv


def test_gae_credits_each_turn_where_it_was_earned():
    batch = _batch(EPISODE, SINGLE)
    values = torch.tensor([[0.1, 0.3, 9.0, 9.0, 0.5, 0.7], [0.2, 0.4, 0, 0, 0, 0]])
    gamma, lam = 0.9, 0.8
    settings = AdvantageSettings(estimator="gae", gamma=gamma, lam=lam)
    got = compute_advantages(_inputs(batch, "gae", values), settings).advantages
    # the episode: r = 0.2 at token 1, 0.8 at token 5; the observation (2-3) is skipped
    want0 = _gae_loop(
        EPISODE["token_rewards"], values[0].tolist(), EPISODE["loss_mask"], gamma, lam
    )
    # by hand: A_5 = 0.8 - 0.7; A_4 = 0.9 * 0.7 - 0.5 + 0.72 * A_5; the next trained token
    # after 1 is 4: A_1 = 0.2 + 0.9 * 0.5 - 0.3 + 0.72 * A_4
    a5 = 0.1
    a4 = 0.9 * 0.7 - 0.5 + 0.72 * a5
    assert want0[5] == pytest.approx(a5, abs=1e-6) and want0[4] == pytest.approx(a4, abs=1e-6)
    assert want0[1] == pytest.approx(0.2 + 0.9 * 0.5 - 0.3 + 0.72 * a4, abs=1e-6)
    # the single-turn sample: its reward 0.5 is the outcome at its last token
    want1 = _gae_loop([0.0, 0.5], values[1, :2].tolist(), [1, 1], gamma, lam)
    torch.testing.assert_close(got[0], torch.tensor(want0))
    torch.testing.assert_close(got[1, :2], torch.tensor(want1))


def test_reinforce_pp_gets_the_rest_as_outcome_and_grpo_the_total():
    # the episode's reward 1.5 is 1.0 by turns plus 0.5 given at the end
    batch = _batch({**EPISODE, "reward": 1.5}, SINGLE)
    inp = _inputs(batch, "reinforce_pp")
    assert inp.rewards.tolist() == pytest.approx([0.5, 0.5])  # reward - sum(token_rewards)
    raw = compute_advantages(inp, AdvantageSettings(estimator="reinforce_pp"))
    # returns-to-go over trained tokens: token 5 = 0.8 + 0.5, token 4 the same, tokens 0-1 +0.2
    assert raw.returns[0].tolist() == pytest.approx([1.5, 1.5, 0, 0, 1.3, 1.3])
    inp = _inputs(batch, "grpo")
    assert inp.token_rewards is None and inp.rewards.tolist() == pytest.approx([1.5, 0.5])
