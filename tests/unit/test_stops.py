"""Stop strings and stop token ids in the built-in sampler and through a rollout source: a
stopped response is the unstopped one (same seed, same draws) cut after the first stop, its
log-probs those of an independent forward, and its loss mask ends there."""

import pytest
import torch

from tests.unit.test_sampler import EOS, reference_logprobs, tiny_model
from unirl.core.errors import ConfigError
from unirl.rollouts.data.stops import stop_ids
from unirl.rollouts.sampler import Sampler

LETTERS = "abcdefghijklmn"  # one letter per id of the 14-id test vocabulary
# One length: prompts of one length are one batch, so an early stop of the whole batch cannot
# shift the generator's draws for another batch.
PROMPTS = [[1, 5, 6, 3], [1, 7, 8, 3], [1, 4, 4, 3], [1, 9, 10, 3]] * 3


def decode(ids):
    return "".join(LETTERS[int(t)] for t in ids)


def sample(model, **stops):
    sampler = Sampler(model, temperature=1.0, top_p=1.0, max_new_tokens=20, eos_id=EOS, seed=3,
                      **stops)  # fmt: skip
    return sampler.generate(PROMPTS)


def first_stop(tokens, ids, strings):
    """The length of the response when it stops: after the first stop id, or after the first
    token with which the decoded text contains a stop string (a plain loop over prefixes)."""
    for k in range(1, len(tokens) + 1):
        if tokens[k - 1] in ids or any(s in decode(tokens[:k]) for s in strings):
            return k
    return None


@pytest.mark.parametrize(("ids", "strings"), [((7,), ()), ((), ("fg", "k")), ((9, 11), ("dd",))])
def test_stopped_responses_are_the_unstopped_ones_cut_at_the_first_stop(ids, strings):
    model = tiny_model(0)
    # The reference: the same seed with eos only, and a budget no sample reaches with eos only
    # (cut below when it does, as the stopped run would be).
    free = sample(model)
    stopped = sample(model, stop_token_ids=ids, stop_strings=strings, decode=decode)
    cut_by_stop = 0
    for prompt, f, s in zip(PROMPTS, free, stopped):
        tokens = f.response_tokens.tolist()
        k = first_stop(tokens, {EOS, *ids}, strings)
        expected = tokens if k is None else tokens[:k]
        assert s.response_tokens.tolist() == expected
        assert s.finished == (k is not None)
        torch.testing.assert_close(
            s.logprobs, reference_logprobs(model, prompt, expected, 1.0), rtol=0, atol=1e-5
        )
        cut_by_stop += k is not None and EOS not in tokens[:k]
    assert cut_by_stop >= 2  # the stops, not eos, ended some samples


def test_stop_ids_outside_the_vocabulary_and_strings_without_decode_are_refused():
    with pytest.raises(ConfigError, match=r"rollout.stop_token_ids holds 99, outside"):
        stop_ids(2, [5, 99], vocab_size=14)
    assert stop_ids(2, [5, 2], vocab_size=14) == [2, 5]
    with pytest.raises(ConfigError, match="stop_strings need decode"):
        Sampler(tiny_model(0), temperature=1.0, top_p=1.0, max_new_tokens=4, eos_id=EOS,
                seed=0, stop_strings=("a",))  # fmt: skip


def test_a_rollout_source_stops_at_rollout_stop_and_the_loss_mask_ends_there():
    from tests.unit.test_rollout_source import make_cfg
    from unirl.rollouts.build import build_rollout_source

    cfg = make_cfg(rollout={"stop": ["5", "77"], "max_new_tokens": 8}, prompts=4, samples=4)
    source = build_rollout_source(cfg)
    batch = source.next_rollout(1)
    tok, stopped = source.tokenizer, 0

    def decode(ids):  # ids beyond the tokenizer (the model has spare rows) read as nothing
        return tok.decode([t for t in ids if t < tok.vocab_size])

    for sample in batch.samples:
        tokens = sample.response_tokens.tolist()
        text = decode(tokens)
        # no stop string before the last token; when one is there, the response ends with it
        assert not any(s in decode(tokens[:-1]) for s in ("5", "77"))
        if any(s in text for s in ("5", "77")):
            assert text.endswith(("5", "77")) and sample.metadata["finished"]
            stopped += 1
    assert stopped >= 1
    padded = batch.padded_responses()
    assert padded.loss_mask.sum(1).tolist() == [len(s.response_tokens) for s in batch.samples]
