"""Hugging Face tokenizers for rollouts: the character tokenizer as a Hugging Face one, and one
adapter through which a rollout source uses any Hugging Face tokenizer.

Why: a serving engine (vLLM) and every Hugging Face tool load a model's tokenizer with
``AutoTokenizer.from_pretrained(folder)``, so the tiny models of the built-in tasks must carry
one. `char_tokenizer_to_hf` builds `CharTokenizer`'s exact ids with the ``tokenizers`` library: a
word-level vocabulary (``<pad> <bos> <eos> <sep>`` then the alphabet), a pre-tokenizer that splits
every character, a post-processor that frames a prompt as ``<bos> text <sep>`` (so
``tok(text)["input_ids"] == CharTokenizer.encode(text, bos=True, sep=True)``) and a decoder that
joins characters without spaces. Special-token strings inside a text are split like any other
characters (``split_special_tokens``), as `CharTokenizer` does.

    hf = char_tokenizer_to_hf(CharTokenizer("0123456789"))
    save_hf_tokenizer(hf, "runs/x/hf")            # AutoTokenizer.from_pretrained("runs/x/hf")
    tok = HFTokenizer(hf, key="model.tokenizer")  # what a prompt task uses
    tok.encode_prompt("12"), tok.decode([5, 6, 2])

Importing this module needs no transformers; the functions that build or load one do.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from unirl.core.errors import ConfigError
from unirl.rollouts.data.tokenizer import BOS_ID, SEP_ID, SPECIAL_TOKENS, CharTokenizer

# Written into tokenizer_config.json instead of transformers 5's "TokenizersBackend", which
# transformers 4 (what most serving engines pin) does not know; both load it as a fast tokenizer.
TOKENIZER_CLASS = "PreTrainedTokenizerFast"
# A folder with none of these holds no tokenizer (AutoTokenizer would guess from config.json).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def char_tokenizer_to_hf(tokenizer: CharTokenizer) -> Any:
    """A `transformers.PreTrainedTokenizerFast` with the ids of ``tokenizer``."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({c: len(SPECIAL_TOKENS) + i for i, c in enumerate(tokenizer.alphabet)})
    backend = Tokenizer(models.WordLevel(vocab))
    # One piece per character; Oniguruma's (?m) lets '.' match a newline too.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    bos, sep = SPECIAL_TOKENS[BOS_ID], SPECIAL_TOKENS[SEP_ID]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {sep}", special_tokens=[(bos, BOS_ID), (sep, SEP_ID)]
    )
    pad, _, eos, _ = SPECIAL_TOKENS
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        sep_token=sep,
        split_special_tokens=True,
        model_max_length=1 << 30,
    )


def save_hf_tokenizer(hf_tokenizer: Any, folder: str | Path) -> None:
    """``hf_tokenizer.save_pretrained(folder)`` with a tokenizer class every transformers
    version loads."""
    folder = Path(folder)
    hf_tokenizer.save_pretrained(str(folder))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = TOKENIZER_CLASS
        config_path.write_text(json.dumps(config, indent=2) + "\n")


def load_hf_tokenizer(path: str, *, key: str) -> Any:
    """``AutoTokenizer.from_pretrained(path)`` from local files; ``key`` is the config key that
    named the folder (shown in the error)."""
    from transformers import AutoTokenizer

    folder = Path(path).expanduser()
    fix = "set model.tokenizer to a folder with tokenizer.json / tokenizer_config.json"
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(
            f"{key}={path!r} holds no tokenizer files ({', '.join(TOKENIZER_FILES)}); {fix}"
        )
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as exc:
        reason = " ".join(str(exc).split())  # one line: the CLI prints one
        raise ConfigError(
            f"{key}={path!r}: AutoTokenizer cannot load it ({reason}); {fix}"
        ) from None


class HFTokenizer:
    """A Hugging Face tokenizer as a task's tokenizer (`unirl.rollouts.data.tasks.TaskTokenizer`):
    ``vocab_size`` counts added tokens, ``eos_id`` ends generation, ``decode`` skips special
    tokens and shows an id beyond the vocabulary (a model may have more rows than its tokenizer)
    as ``<unk:ID>``, as `CharTokenizer` does."""

    def __init__(self, hf_tokenizer: Any, *, key: str) -> None:
        if hf_tokenizer.eos_token_id is None:
            raise ConfigError(
                f"{key}: the tokenizer has no eos token, so generation could not stop; use a "
                "tokenizer with eos_token set"
            )
        self.hf = hf_tokenizer
        self.eos_id = int(hf_tokenizer.eos_token_id)
        self.vocab_size = len(hf_tokenizer)

    def encode_prompt(self, text: str) -> list[int]:
        """The prompt's ids with the tokenizer's own special tokens (``<bos> text <sep>`` for a
        character tokenizer, the BOS of a Llama tokenizer)."""
        return list(self.hf(text, add_special_tokens=True)["input_ids"])

    def decode(self, ids: Iterable[int]) -> str:
        parts: list[str] = []
        run: list[int] = []
        for token in map(int, ids):
            if 0 <= token < self.vocab_size:
                run.append(token)
                continue
            parts.append(self.hf.decode(run, skip_special_tokens=True))
            parts.append(f"<unk:{token}>")
            run = []
        parts.append(self.hf.decode(run, skip_special_tokens=True))
        return "".join(parts)

    def special_token_ids(self) -> dict[str, int]:
        """The Hugging Face config keys naming the special tokens this tokenizer has."""
        ids = {
            "bos_token_id": self.hf.bos_token_id,
            "eos_token_id": self.hf.eos_token_id,
            "pad_token_id": self.hf.pad_token_id,
        }
        return {k: int(v) for k, v in ids.items() if v is not None}
