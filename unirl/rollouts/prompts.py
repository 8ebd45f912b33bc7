"""Prompts read from a JSONL file (``rollout.prompts``), scored by a named reward function.

One JSON object per line::

    {"prompt": "Ann has 3 apples and buys 4 more. How many apples does Ann have?",
     "metadata": {"answer": 7}}
    {"prompt_tokens": [1, 17, 22, 3], "metadata": {"answer": "12"}}

``prompt`` (text) or ``prompt_tokens`` (ids), exactly one; ``metadata`` (an object, optional) is
handed to the reward function (``rollout.reward``, `unirl.rollouts.rewards`) with each of the
prompt's responses. Blank lines are skipped. Text is tokenized by the model's Hugging Face
tokenizer with its special tokens (``tok(text)["input_ids"]``): ``model.tokenizer`` if set,
else the tokenizer saved with ``model.path``, else (a model built from ``model.hf_config``) the
character tokenizer over every character of the file's prompts and metadata strings (code-point
order; prompts framed ``<bos> text <sep>``). No chat template is applied: write it into the text,
or give token ids.

The file is read and checked whole when the run starts: each mistake is a `RolloutDataError`
naming the file line, the field and the fix. A prompt longer than ``model.max_seq_len -
rollout.max_new_tokens`` tokens is an error naming its line, unless
``rollout.skip_long_prompts: true``, which drops such prompts with one warning (count and
first lines).

The stream goes round the file in epochs, each a fresh permutation drawn from ``train.seed``
and the epoch number, so the same seed and file give the same prompts, and a checkpoint needs
only the count of prompts drawn (`state_dict`): ``--resume`` continues where the run stopped.
Every rank reads the same file and draws the same stream.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from unirl.core.errors import ConfigError, RolloutDataError
from unirl.core.run.config import UnirlConfig
from unirl.rollouts.hf_tokenizer import (
    HFTokenizer,
    char_tokenizer_to_hf,
    load_hf_tokenizer,
)
from unirl.rollouts.rewards import NamedReward
from unirl.rollouts.tasks import Problem
from unirl.rollouts.tokenizer import CharTokenizer

logger = logging.getLogger(__name__)

FIELDS = ("prompt", "prompt_tokens", "metadata")
NAME = "prompts"


@attrs.frozen(kw_only=True)
class PromptRecord:
    """One line of a prompt file, checked: text or ids, and the metadata."""

    line: int
    text: str | None
    tokens: tuple[int, ...] | None
    metadata: dict[str, Any]


def read_prompt_records(path: Path) -> list[PromptRecord]:
    """Every prompt of the file, each line checked (`RolloutDataError` names line and field)."""
    if not path.is_file():
        raise ConfigError(
            f"rollout.prompts={str(path)!r} does not exist or is not a file; give the path of a "
            'JSONL prompt file (one {"prompt": ..., "metadata": {...}} object per line)'
        )
    records = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if raw.strip():
                records.append(_parse_line(raw, f"{path} line {number}", number))
    if not records:
        raise RolloutDataError(
            f"{path}: the prompt file holds no prompts; write one JSON object per line"
        )
    return records


def _parse_line(raw: bytes, where: str, number: int) -> PromptRecord:
    try:
        record = json.loads(raw)
    except ValueError as err:
        raise RolloutDataError(
            f"{where}: not valid JSON ({err}); write one JSON object per line"
        ) from None
    if not isinstance(record, dict):
        raise RolloutDataError(
            f'{where}: expected a JSON object such as {{"prompt": "...", "metadata": '
            f'{{"answer": 7}}}}, got {type(record).__name__}'
        )
    unknown = sorted(set(record) - set(FIELDS))
    if unknown:
        raise RolloutDataError(
            f"{where}: unknown field {unknown[0]!r}; a prompt line holds 'prompt' (text) or "
            "'prompt_tokens' (ids), and optionally 'metadata' (an object, e.g. the answer)"
        )
    has_text, has_tokens = "prompt" in record, "prompt_tokens" in record
    if has_text == has_tokens:
        raise RolloutDataError(
            f"{where}: give exactly one of 'prompt' (text) and 'prompt_tokens' (ids), "
            f"found {'both' if has_text else 'neither'}"
        )
    text, tokens = record.get("prompt"), record.get("prompt_tokens")
    if has_text and (not isinstance(text, str) or not text):
        raise RolloutDataError(
            f"{where}: field 'prompt' is {text!r}; give the prompt as a non-empty string"
        )
    if has_tokens:
        if (
            not isinstance(tokens, list)
            or not tokens
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens)
        ):
            raise RolloutDataError(
                f"{where}: field 'prompt_tokens' must be a non-empty list of token ids "
                f"(integers >= 0), got {_short(tokens)}"
            )
        tokens = tuple(tokens)
    metadata = record.get("metadata", {})
    if not isinstance(metadata, dict):
        raise RolloutDataError(
            f"{where}: field 'metadata' is {type(metadata).__name__}; give an object such as "
            '{"answer": 7}, or leave it out'
        )
    return PromptRecord(line=number, text=text, tokens=tokens, metadata=metadata)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _strings(value: Any) -> Iterator[str]:
    """Every string and number inside a metadata value (what a response may have to write)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield str(value)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def prompt_alphabet(records: Sequence[PromptRecord]) -> CharTokenizer:
    """The character tokenizer over every character of the prompts and their metadata."""
    texts = [r.text for r in records if r.text is not None]
    texts += [s for r in records for s in _strings(r.metadata)]
    try:
        return CharTokenizer.from_texts(texts)
    except ValueError as exc:
        raise ConfigError(
            f"rollout.prompts: the character tokenizer over the file cannot be built ({exc}); "
            "set model.tokenizer to a Hugging Face tokenizer folder"
        ) from None


def prompt_tokenizer(cfg: UnirlConfig, records: Sequence[PromptRecord]) -> HFTokenizer:
    """The tokenizer prompts go through: ``model.tokenizer``, else ``model.path``'s, else the
    character tokenizer over the file (a model built from ``model.hf_config``)."""
    m = cfg.model
    if m.tokenizer is not None:
        return HFTokenizer(
            load_hf_tokenizer(m.tokenizer, key="model.tokenizer"), key="model.tokenizer"
        )
    if m.path is not None:
        return HFTokenizer(load_hf_tokenizer(m.path, key="model.path"), key="model.path")
    hf = char_tokenizer_to_hf(prompt_alphabet(records))
    return HFTokenizer(hf, key="the character tokenizer of rollout.prompts")


class PromptFileTask:
    """A `Task` (with `BatchRewardTask` and `StatefulTask`) over a prompt file: problems in a
    seeded per-epoch order, rewards from ``rollout.reward``. ``sample_problem`` ignores the rng
    it is given: the order is a function of the seed and the count drawn."""

    name = NAME

    def __init__(
        self,
        path: str | Path,
        tokenizer: HFTokenizer,
        reward: NamedReward,
        *,
        seed: int,
        max_prompt_length: int,
        skip_long_prompts: bool = False,
        records: Sequence[PromptRecord] | None = None,
    ) -> None:
        self.path = Path(path)
        self.tokenizer = tokenizer
        self.reward_fn = reward
        self.seed = seed
        self.digest = _sha256(self.path)
        records = read_prompt_records(self.path) if records is None else records
        self.problems, too_long = self._problems(records, max_prompt_length)
        if too_long and not skip_long_prompts:
            line, length = too_long[0]
            raise RolloutDataError(
                f"{self.path} line {line}: the prompt is {length} tokens, longer than "
                f"model.max_seq_len - rollout.max_new_tokens = {max_prompt_length}; shorten it, "
                "raise model.max_seq_len, lower rollout.max_new_tokens, or set "
                "rollout.skip_long_prompts: true to drop such prompts"
            )
        if too_long:
            logger.warning(
                "%s: %d of %d prompts are longer than model.max_seq_len - rollout.max_new_tokens "
                "= %d tokens and are skipped (rollout.skip_long_prompts), lines %s",
                self.path, len(too_long), len(records), max_prompt_length,
                ", ".join(str(line) for line, _ in too_long[:5]) + (" ..." if len(too_long) > 5 else ""),
            )  # fmt: skip
        if not self.problems:
            raise RolloutDataError(
                f"{self.path}: every prompt is longer than {max_prompt_length} tokens; raise "
                "model.max_seq_len or lower rollout.max_new_tokens"
            )
        self.max_prompt_length = max(len(p.prompt_tokens) for p in self.problems)
        self.max_target_length = 0  # no target tokens: the reward reads the metadata
        self._drawn = 0
        self._epoch, self._order = -1, list(range(len(self.problems)))

    def _problems(
        self, records: Sequence[PromptRecord], limit: int
    ) -> tuple[list[Problem], list[tuple[int, int]]]:
        vocab = self.tokenizer.vocab_size
        problems, too_long = [], []
        for r in records:
            where = f"{self.path} line {r.line}"
            if r.tokens is not None:
                tokens = list(r.tokens)
                bad = [t for t in tokens if t >= vocab]
                if bad:
                    raise RolloutDataError(
                        f"{where}: field 'prompt_tokens' holds id {bad[0]}, outside the "
                        f"tokenizer's vocabulary of {vocab}; write ids of the model's tokenizer"
                    )
                text = self.tokenizer.decode(tokens)
            else:
                assert r.text is not None
                tokens, text = self.tokenizer.encode_prompt(r.text), r.text
            if len(tokens) > limit:
                too_long.append((r.line, len(tokens)))
                continue
            problems.append(
                Problem(prompt_tokens=tokens, prompt_text=text, metadata=r.metadata, origin=where)
            )
        return problems, too_long

    @property
    def num_prompts(self) -> int:
        return len(self.problems)

    def _index(self, drawn: int) -> int:
        epoch, position = divmod(drawn, len(self.problems))
        if epoch != self._epoch:
            # A string seed is hashed with SHA-512: the same order on every machine and run.
            self._order = list(range(len(self.problems)))
            random.Random(f"unirl-prompts/{self.seed}/{epoch}").shuffle(self._order)
            self._epoch = epoch
        return self._order[position]

    def sample_problem(self, rng: random.Random) -> Problem:
        problem = self.problems[self._index(self._drawn)]
        self._drawn += 1
        return problem

    def reward(self, problem: Problem, response_tokens: Sequence[int]) -> float:
        return self.rewards([problem], [response_tokens])[0]

    def rewards(
        self, problems: Sequence[Problem], responses: Sequence[Sequence[int]]
    ) -> list[float]:
        return self.reward_fn(
            [p.prompt_text for p in problems],
            [self.tokenizer.decode(r) for r in responses],
            [p.metadata for p in problems],
            prompt_tokens=[p.prompt_tokens for p in problems],
            response_tokens=responses,
            origins=[p.origin for p in problems],
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "file": str(self.path),
            "sha256": self.digest,
            "num_prompts": self.num_prompts,
            "seed": self.seed,
            "prompts_drawn": self._drawn,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state["sha256"] != self.digest or state["num_prompts"] != self.num_prompts:
            logger.warning(
                "rollout.prompts %s is not the file the checkpoint read (%s, %d prompts, now %d): "
                "continuing after prompt %d of the new file's order",
                self.path, state["file"], state["num_prompts"], self.num_prompts,
                state["prompts_drawn"],
            )  # fmt: skip
        if state["seed"] != self.seed:
            logger.warning(
                "the checkpoint drew prompts with train.seed=%s, this run uses %s: the prompt "
                "order after the checkpoint differs from the uninterrupted run's",
                state["seed"], self.seed,
            )  # fmt: skip
        self._drawn = int(state["prompts_drawn"])


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def make_prompt_task(cfg: UnirlConfig) -> PromptFileTask:
    """The task of ``rollout.prompts`` and ``rollout.reward`` (file read, tokenized, checked)."""
    r = cfg.rollout
    assert r.prompts is not None and r.reward is not None  # the config checks both
    reward = NamedReward(r.reward, r.reward_options)
    records = read_prompt_records(Path(r.prompts))
    return PromptFileTask(
        r.prompts,
        prompt_tokenizer(cfg, records),
        reward,
        seed=cfg.train.seed,
        max_prompt_length=cfg.model.max_seq_len - r.max_new_tokens,
        skip_long_prompts=r.skip_long_prompts,
        records=records,
    )
