"""An episode's calls as training samples, without re-tokenising.

The calls are taken in the order the gateway received them. A call whose prompt begins with a
sample's tokens so far (its first prompt, then every response token) extends that sample: the
prompt's further tokens (what the agent added: a tool's answer, the chat template's framing of
the next user turn) are appended with loss mask 0 and log-prob 0, then the call's completion
with mask 1 and the engine's log-probs. A call that extends no sample starts a new one: the
episode forks (a chat template that drops earlier reasoning from the history, an agent that
rewrote or summarised its context, calls made in parallel). Nothing is ever decoded and encoded
again, so a sample holds exactly the ids the engine saw and sampled.

    forks = assemble(calls)            # one Fork per sample, in the order they started
    forks[-1].response, forks[-1].mask, forks[-1].logprobs, forks[-1].call_ends
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from unirl.rollouts.gateway.recording import CallRecord


@attrs.define
class Fork:
    """One sample of an episode: ``prompt`` (its first call's prompt) and the response built
    from its calls; ``call_ends[i]`` is the response index of call ``calls[i]``'s last token."""

    prompt: list[int]
    response: list[int] = attrs.field(factory=list)
    mask: list[bool] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    calls: list[CallRecord] = attrs.field(factory=list)
    call_ends: list[int] = attrs.field(factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.response

    def extends(self, call: CallRecord) -> bool:
        """Whether ``call``'s prompt begins with every token of this sample so far."""
        n = len(self.prompt) + len(self.response)
        return len(call.prompt_ids) >= n and list(call.prompt_ids[:n]) == self.tokens

    def add(self, call: CallRecord) -> None:
        inserted = call.prompt_ids[len(self.prompt) + len(self.response) :]
        self.response.extend(inserted)
        self.mask.extend([False] * len(inserted))
        self.logprobs.extend([0.0] * len(inserted))
        self.response.extend(call.completion_ids)
        self.mask.extend([True] * len(call.completion_ids))
        self.logprobs.extend(call.logprobs)
        self.calls.append(call)
        self.call_ends.append(len(self.response) - 1)


def assemble(calls: Sequence[CallRecord]) -> list[Fork]:
    """The samples of an episode's ``calls`` (in arrival order): each call joins the newest
    sample it extends, else it starts a fork."""
    forks: list[Fork] = []
    for call in calls:
        if not call.completion_ids:
            continue  # nothing sampled (max_tokens reached at once): nothing to train on
        target = next((f for f in reversed(forks) if f.extends(call)), None)
        if target is None:
            target = Fork(prompt=list(call.prompt_ids))
            forks.append(target)
        target.add(call)
    return forks
