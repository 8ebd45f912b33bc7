"""The gateway's pure parts against hand-written expectations: an episode's calls assembled into
samples (a call that extends the sample joins it, the tokens in between masked; else a fork),
tool calls read from a completion's text, a call's settings checked against the run's, and a
completion cut at a call's own stop string."""

from __future__ import annotations

import pytest

from unirl.rollouts.gateway.assembly import assemble
from unirl.rollouts.gateway.protocol import (
    Limits,
    RequestError,
    cut_at_stop,
    parse_tool_calls,
    sampling,
)
from unirl.rollouts.gateway.recording import CallRecord, EpisodeFailure, EpisodeRecord


def call(index, prompt, completion, logprobs=None, version=0):
    return CallRecord(
        index=index,
        endpoint="chat",
        prompt_ids=tuple(prompt),
        completion_ids=tuple(completion),
        logprobs=tuple(logprobs or [-0.5] * len(completion)),
        finished=True,
        policy_version=version,
    )


def test_calls_that_extend_join_one_sample_with_the_inserted_tokens_masked():
    calls = [
        call(0, [1, 5, 3], [7, 8], [-0.1, -0.2]),
        # prompt = call 0's prompt + completion + a tool answer [9, 9] + the template's [4]
        call(1, [1, 5, 3, 7, 8, 9, 9, 4], [6, 2], [-0.3, -0.4], version=1),
    ]
    (fork,) = assemble(calls)
    assert fork.prompt == [1, 5, 3]
    assert fork.response == [7, 8, 9, 9, 4, 6, 2]
    assert fork.mask == [True, True, False, False, False, True, True]
    assert fork.logprobs == [-0.1, -0.2, 0.0, 0.0, 0.0, -0.3, -0.4]
    assert fork.call_ends == [1, 6]
    assert [c.index for c in fork.calls] == [0, 1]


def test_a_call_that_does_not_extend_forks_and_keeps_its_own_tokens():
    calls = [
        call(0, [1, 5, 3], [7, 8]),
        # the template dropped the earlier completion's first token (its "reasoning")
        call(1, [1, 5, 3, 8, 9], [6]),
        call(2, [1, 5, 3, 8, 9, 6, 4], [2]),  # extends the fork, not the first sample
    ]
    first, second = assemble(calls)
    assert first.tokens == [1, 5, 3, 7, 8] and first.call_ends == [1]
    assert second.prompt == [1, 5, 3, 8, 9]
    assert second.response == [6, 4, 2] and second.mask == [True, False, True]
    assert [c.index for c in second.calls] == [1, 2]


def test_parallel_calls_from_one_prefix_fork():
    calls = [call(0, [1, 3], [5]), call(1, [1, 3], [6]), call(2, [1, 3, 6, 4], [7])]
    a, b = assemble(calls)
    assert a.response == [5] and b.response == [6, 4, 7]  # call 2 extends call 1, the newest


def test_parse_hermes_tool_calls():
    text = 'Let me look.<tool_call>{"name": "lookup", "arguments": {"q": "x"}}</tool_call>'
    content, calls = parse_tool_calls(text, "call_")
    assert content == "Let me look."
    assert calls == [
        {
            "id": "call_0",
            "type": "function",
            "function": {"name": "lookup", "arguments": '{"q": "x"}'},
        }
    ]
    # not a function call: stays content
    assert parse_tool_calls("<tool_call>oops</tool_call>", "c") == (
        "<tool_call>oops</tool_call>",
        [],
    )


LIMITS = Limits(temperature=1.0, top_p=1.0, max_new_tokens=8, max_seq_len=20)


def test_sampling_settings_against_the_run():
    assert sampling({}, LIMITS, prompt_len=5).max_tokens == 8
    assert sampling({"max_tokens": 3}, LIMITS, prompt_len=5).max_tokens == 3
    assert sampling({"max_tokens": 30}, LIMITS, prompt_len=15).max_tokens == 5  # room left
    assert sampling({"stop": "x", "temperature": 1.0}, LIMITS, prompt_len=5).stop == ("x",)
    with pytest.raises(RequestError, match=r"temperature=0.7: the policy samples at "):
        sampling({"temperature": 0.7}, LIMITS, prompt_len=5)
    with pytest.raises(RequestError, match="context length exceeded"):
        sampling({}, LIMITS, prompt_len=20)
    with pytest.raises(RequestError, match="n=2"):
        sampling({"n": 2}, LIMITS, prompt_len=5)


def test_cut_at_a_calls_stop_string():
    decode = lambda ids: "".join("abcdef"[i] for i in ids)  # noqa: E731
    assert cut_at_stop([0, 1, 2, 3], ["cd"], decode) == (4, "cd")
    assert cut_at_stop([0, 1, 2, 3], ["bc"], decode) == (3, "bc")
    assert cut_at_stop([0, 1], ["z"], decode) == (2, None)


def test_episode_limits_name_the_outcome():
    ep = EpisodeRecord("k", "episode 0", seed=0, max_calls=2, max_in_flight=1)
    assert ep.begin_call() == 0
    with pytest.raises(EpisodeFailure, match="max_calls_in_flight=1") as err:
        ep.begin_call()
    assert err.value.outcome == "too_many_calls_in_flight" and ep.failure is err.value
    ep.end_call(call(0, [1], [2]))
    assert ep.begin_call() == 1
    ep.end_call(None)
    with pytest.raises(EpisodeFailure) as err:
        ep.begin_call()
    assert err.value.outcome == "too_many_calls"
    assert [c.index for c in ep.close()] == [0]
    assert ep.call_seed(0) != ep.call_seed(1)


def test_router_gives_a_new_episode_the_least_loaded_engine():
    from unirl.rollouts.gateway.routing import EngineRouter

    router = EngineRouter([object(), object(), object()])  # type: ignore[list-item]
    # open episodes per engine after each step, written out:
    assert [router.assign() for _ in range(4)] == [0, 1, 2, 0]  # open [2, 1, 1]
    router.release(1)  # open [2, 0, 1]
    assert router.assign() == 1  # open [2, 1, 1]; given [2, 2, 1]
    assert router.assign() == 2  # ties on open (1, 1): engine 2 was given fewer
    router.release(0)
    router.release(0)  # open [0, 1, 2]
    assert router.assign() == 0


def test_a_call_is_stamped_with_the_version_that_generated_it():
    """A call that waits while a weight sync holds the engine's lock is generated by the synced
    weights, and stamped with their version (not with the version when it arrived)."""
    import threading
    import time

    from unirl.rollouts.gateway.engines import GenerationQueue
    from unirl.rollouts.serving.engine import EngineSample

    class Fixed:
        def generate(self, prompts, seeds, max_new_tokens):
            return [EngineSample(response_tokens=(4,), logprobs=(-1.0,), finished=True)] * len(
                prompts
            )

    lock, version = threading.Lock(), [3]
    queue = GenerationQueue(Fixed(), max_batch=8, version=lambda: version[0], lock=lock)
    try:
        with lock:  # a sync in progress
            future = queue.submit([1, 2], seed=0, max_new_tokens=2)
            time.sleep(0.05)  # the queue's thread has taken the call and waits for the lock
            version[0] = 4  # the sync lands
        served = future.result(timeout=10)
    finally:
        queue.close()
    assert served.policy_version == 4 and served.sample.response_tokens == (4,)
