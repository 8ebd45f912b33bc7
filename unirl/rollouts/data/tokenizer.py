"""A character-level tokenizer for the built-in tasks: one token per character of a small alphabet.

The built-in tasks (digit reversal, small sums) need a dozen symbols, so a model with a vocabulary
of 14-16 entries can learn them in minutes on a CPU, and every id means one visible character: a
sampled response can be read off its token ids. Ids 0-3 are the special tokens, the alphabet
follows in order:

    tok = CharTokenizer("0123456789+")
    tok.encode("12+7", bos=True, sep=True)   # [BOS, 5, 6, 14, 11, SEP]
    tok.decode([7, 6, 2])                     # "32" (special tokens skipped)

The special ids match Hugging Face's Llama defaults (bos 1, eos 2), so a Llama config built for a
task needs no special-token keys. `unirl.rollouts.data.hf_tokenizer.char_tokenizer_to_hf` builds the
same tokenizer as a Hugging Face one (saved with the model's export, loadable by
``AutoTokenizer``), with the same ids.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
SEP_ID = 3
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<sep>")
# Room for the alphabet of a text prompt file (letters, digits, punctuation); beyond this a
# task should use a real subword tokenizer, not this one.
MAX_VOCAB_SIZE = 256


def _check_alphabet(instance: CharTokenizer, attribute: attrs.Attribute, alphabet: str) -> None:
    if not alphabet:
        raise ValueError("CharTokenizer alphabet is empty; give the characters a task writes")
    repeated = sorted({c for c in alphabet if alphabet.count(c) > 1})
    if repeated:
        raise ValueError(f"CharTokenizer alphabet {alphabet!r} repeats {repeated}; list each once")
    if len(alphabet) + len(SPECIAL_TOKENS) > MAX_VOCAB_SIZE:
        raise ValueError(
            f"CharTokenizer alphabet {alphabet!r} has {len(alphabet)} characters; with the "
            f"{len(SPECIAL_TOKENS)} special tokens the vocabulary must stay <= {MAX_VOCAB_SIZE}; "
            "use a subword tokenizer (model.tokenizer) for text this varied"
        )


@attrs.frozen
class CharTokenizer:
    """Special tokens ``<pad> <bos> <eos> <sep>`` (ids 0-3), then one id per alphabet character.

    ``<sep>`` ends a prompt (the model answers after it); ``<eos>`` ends a response and stops
    generation.
    """

    alphabet: str = attrs.field(validator=_check_alphabet)
    _ids: dict[str, int] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        ids = {c: len(SPECIAL_TOKENS) + i for i, c in enumerate(self.alphabet)}
        object.__setattr__(self, "_ids", ids)

    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID
    sep_id = SEP_ID

    @classmethod
    def from_texts(cls, texts: Iterable[str]) -> CharTokenizer:
        """The tokenizer over every character the texts use, in code-point order (so the same
        texts give the same ids whatever order they come in)."""
        return cls("".join(sorted(set().union(*map(set, texts)))))

    @property
    def vocab_size(self) -> int:
        return len(SPECIAL_TOKENS) + len(self.alphabet)

    def encode(
        self, text: str, *, bos: bool = False, sep: bool = False, eos: bool = False
    ) -> list[int]:
        """Ids of ``text``, optionally framed as ``<bos> text <sep>`` (a prompt) or
        ``text <eos>`` (a finished answer)."""
        ids = [BOS_ID] if bos else []
        for position, char in enumerate(text):
            if char not in self._ids:
                raise ValueError(
                    f"CharTokenizer.encode: character {char!r} at position {position} of "
                    f"{text!r} is not in the alphabet {self.alphabet!r}"
                )
            ids.append(self._ids[char])
        if sep:
            ids.append(SEP_ID)
        if eos:
            ids.append(EOS_ID)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        """Text of ``ids``. Ids the model may emit beyond this vocabulary (a model config with
        a larger ``vocab_size``) read as ``<unk:ID>``, so a sampled response always decodes."""
        parts = []
        for token in ids:
            token = int(token)
            if 0 <= token < len(SPECIAL_TOKENS):
                if not skip_special:
                    parts.append(SPECIAL_TOKENS[token])
            elif len(SPECIAL_TOKENS) <= token < self.vocab_size:
                parts.append(self.alphabet[token - len(SPECIAL_TOKENS)])
            else:
                parts.append(f"<unk:{token}>")
        return "".join(parts)

    def special_token_ids(self) -> dict[str, int]:
        """The Hugging Face config keys naming this tokenizer's special tokens."""
        return {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
