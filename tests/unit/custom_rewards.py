"""Reward functions loaded by `module:function` in tests (a module of their own: importing it
registers nothing)."""

import math


def length_reward(prompts, responses, metadata, *, prompt_tokens, response_tokens, scale=1.0):
    """scale x the number of response characters (so a test can recompute it per sample)."""
    return [scale * len(r) for r in responses]


def fails_on_flagged(prompts, responses, metadata, **_):
    """Raises for a prompt whose metadata carries "boom"."""
    for m in metadata:
        if m.get("boom"):
            raise ValueError("cannot score this one")
    return [0.0] * len(responses)


def one_short(prompts, responses, metadata, **_):
    return [0.0] * (len(responses) - 1)


def nan_for_flagged(prompts, responses, metadata, **_):
    return [math.nan if m.get("boom") else 0.0 for m in metadata]


def text_reward(prompts, responses, metadata, **_):
    return ["high"] * len(responses)


def no_metadata_parameter(prompts, responses):
    return [0.0] * len(responses)
