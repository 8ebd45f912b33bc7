"""Chat prompts: a list of ``{"role", "content"}`` messages turned into the prompt ids an
instruct model expects, through its tokenizer's own chat template.

Why the template and not hand-written text: an instruct model was trained on exactly the
framing its template writes (role markers, special tokens, the opening of the assistant turn);
a prompt framed any other way is off its distribution. The ids are those of
``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)``: the
conversation so far and the start of the assistant's turn, which the policy then completes.

``rollout.system_prompt`` (when set) is put first as ``{"role": "system", ...}``, unless the
prompt's messages begin with a system message of their own (a dataset that carries one keeps
it). ``rollout.apply_chat_template: true`` makes a text prompt the single user message
``[{"role": "user", "content": text}]``.

    ids = chat_prompt_ids(hf_tokenizer, [{"role": "user", "content": "2+3?"}],
                          system_prompt="Answer with a number.", where="p.jsonl line 1")
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from unirl.core.errors import ConfigError, RolloutDataError

Messages = tuple[dict[str, str], ...]


def check_messages(value: Any, where: str, field: str) -> Messages:
    """``value`` as chat messages: a non-empty list of objects, each with a string ``role`` and
    a string ``content``; `RolloutDataError` names the sample, the field and the message."""
    example = '[{"role": "user", "content": "..."}]'
    if not isinstance(value, (list, tuple)) or not value:
        raise RolloutDataError(
            f"{where}: field {field!r} must be a non-empty list of chat messages such as "
            f"{example}, got {_short(value)}"
        )
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not {"role", "content"} <= set(message):
            raise RolloutDataError(
                f"{where}: {field}[{i}] is {_short(message)}; each chat message is an object "
                f'with "role" and "content", e.g. {example}'
            )
        role, content = message["role"], message["content"]
        if not isinstance(role, str) or not role or not isinstance(content, str):
            raise RolloutDataError(
                f"{where}: {field}[{i}] has role {role!r} and content {_short(content)}; both "
                "must be strings (the role non-empty)"
            )
        messages.append({"role": role, "content": content})
    return tuple(messages)


def with_system_prompt(messages: Messages, system_prompt: str | None) -> Messages:
    """``messages`` with ``system_prompt`` first, unless they start with a system message."""
    if system_prompt is None or messages[0]["role"] == "system":
        return messages
    return ({"role": "system", "content": system_prompt}, *messages)


def has_chat_template(hf_tokenizer: Any) -> bool:
    return bool(getattr(hf_tokenizer, "chat_template", None))


def chat_prompt_ids(
    hf_tokenizer: Any, messages: Sequence[dict[str, str]], *, system_prompt: str | None, where: str
) -> list[int]:
    """The prompt ids of ``messages`` (system prompt added) through the tokenizer's chat
    template, with the generation prompt (the opening of the assistant's turn)."""
    if not has_chat_template(hf_tokenizer):
        raise ConfigError(
            f"{where}: a chat prompt needs a tokenizer with a chat template, and this one has "
            "none; set model.tokenizer (or model.path) to a folder whose tokenizer_config.json "
            "(or chat_template.jinja) holds one, e.g. an instruct model's, or give text prompts "
            "without rollout.apply_chat_template"
        )
    full = with_system_prompt(tuple(messages), system_prompt)
    try:
        ids = hf_tokenizer.apply_chat_template(
            [dict(m) for m in full], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    except Exception as exc:  # the template is user-supplied Jinja: it may raise anything
        raise RolloutDataError(
            f"{where}: the tokenizer's chat template failed on this prompt "
            f"({type(exc).__name__}: {exc}); check the roles the template accepts"
        ) from None
    return [int(t) for t in ids]


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
