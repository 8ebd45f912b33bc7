"""Where generation stops, beside the tokenizer's eos: ``rollout.stop_token_ids`` (more ids that
end a response, kept as its last token) and ``rollout.stop`` (strings: a response ends with
the first token after which its decoded text contains one), honoured alike by the built-in
sampler (`unirl.rollouts.sampler`) and by vLLM (``SamplingParams.stop`` / ``stop_token_ids``).

The response's tokens end at the stop, so its loss mask does too: nothing after the stop is
trained on. The stop string stays in the response (its text and its tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from unirl.core.errors import ConfigError
from unirl.rollouts.data.tasks import TaskTokenizer
from unirl.rollouts.data.tokenizer import CharTokenizer


def stop_ids(eos_id: int, extra: Sequence[int], *, vocab_size: int) -> list[int]:
    """The ids that end a response: eos and ``rollout.stop_token_ids``, each inside the
    model's vocabulary."""
    outside = [t for t in extra if t >= vocab_size]
    if outside:
        raise ConfigError(
            f"rollout.stop_token_ids holds {outside[0]}, outside the model's vocabulary of "
            f"{vocab_size}; give ids of the model's tokenizer"
        )
    return sorted({int(eos_id), *map(int, extra)})


def save_task_tokenizer(tokenizer: TaskTokenizer, folder: Path) -> None:
    """Save the task's tokenizer as a Hugging Face one into ``folder`` (for an engine that
    matches stop strings on decoded text)."""
    from unirl.rollouts.data.hf_tokenizer import (
        HFTokenizer,
        char_tokenizer_to_hf,
        save_hf_tokenizer,
    )

    if isinstance(tokenizer, HFTokenizer):
        hf = tokenizer.hf
    elif isinstance(tokenizer, CharTokenizer):
        hf = char_tokenizer_to_hf(tokenizer)
    else:
        raise ConfigError(
            f"rollout.stop with a task whose tokenizer is a {type(tokenizer).__name__}: the "
            "engine matches stop strings on text and needs a Hugging Face tokenizer; use "
            "rollout.stop_token_ids, or give the task a Hugging Face tokenizer"
        )
    save_hf_tokenizer(hf, folder)


def stop_text(tokenizer: TaskTokenizer, ids: Sequence[int]) -> str:
    """The text stop strings are looked for in: ids beyond the tokenizer (a model with spare
    rows) read as nothing, as a serving engine's detokenizer reads them (the sampler's rule
    too)."""
    vocab = tokenizer.vocab_size
    return tokenizer.decode([t for t in ids if t < vocab])
