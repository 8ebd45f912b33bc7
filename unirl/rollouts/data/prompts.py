"""Prompts read from a dataset (``rollout.prompts``), scored by a named reward function.

The dataset is a JSONL file, a Parquet file or a Hugging Face ``datasets`` folder
(`unirl.rollouts.data.prompt_datasets`). Unmapped, each row is a unirl prompt line::

    {"prompt": "Ann has 3 apples and buys 4 more. How many apples does Ann have?",
     "metadata": {"answer": 7}}
    {"messages": [{"role": "user", "content": "What is 2+3?"}], "metadata": {"answer": 5}}
    {"prompt_tokens": [1, 17, 22, 3], "metadata": {"answer": "12"}}

``prompt`` (text), ``messages`` (chat messages) or ``prompt_tokens`` (ids), exactly one;
``metadata`` (an object, optional) is handed to the reward function (``rollout.reward``,
`unirl.rollouts.rewards.registry`) with each of the prompt's responses. A published dataset keeps its
own column names through the mapping (`ColumnMap`): ``rollout.prompt_key: question`` reads the
prompt from ``question``, ``rollout.answer_key: answer`` puts that column in
``metadata["answer"]``, ``rollout.metadata_keys: [level]`` copies more columns.

Text is tokenized by the model's Hugging Face tokenizer with its special tokens
(``tok(text)["input_ids"]``): ``model.tokenizer`` if set, else the tokenizer saved with
``model.path``, else (a model built from ``model.hf_config``) the character tokenizer over every
character of the file's prompts and metadata strings (code-point order; prompts framed ``<bos>
text <sep>``). Chat messages go through the tokenizer's chat template with the generation
prompt (`unirl.rollouts.data.chat`), ``rollout.system_prompt`` first; ``rollout.apply_chat_template:
true`` does the same for text prompts (each one user message).

The dataset is read and checked whole when the run starts: each mistake is a
`RolloutDataError` naming the row (``FILE line N`` / ``FILE row N``), the field and the fix. A
prompt longer than ``model.max_seq_len - rollout.max_new_tokens`` tokens is an error naming its
row, unless ``rollout.skip_long_prompts: true``, which drops such prompts with one warning
(count and first rows).

The stream goes round the dataset in epochs, each a fresh permutation drawn from
``train.seed`` and the epoch number, so the same seed and data give the same prompts, and a
checkpoint needs only the count of prompts drawn (`state_dict`): ``--resume`` continues where
the run stopped. Every rank reads the same data and draws the same stream.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from unirl.core.config.run_config import RolloutConfig, UnirlConfig
from unirl.core.errors import ConfigError, RolloutDataError, RunError
from unirl.rollouts.data.chat import chat_prompt_ids, check_messages
from unirl.rollouts.data.hf_tokenizer import (
    HFTokenizer,
    char_tokenizer_to_hf,
    load_hf_tokenizer,
)
from unirl.rollouts.data.prompt_datasets import TableRow, content_digest, iter_rows
from unirl.rollouts.data.tasks import Problem
from unirl.rollouts.data.tokenizer import CharTokenizer
from unirl.rollouts.rewards.registry import NamedReward, RewardRun

logger = logging.getLogger(__name__)

FIELDS = ("prompt", "prompt_tokens", "messages", "metadata")
NAME = "prompts"


@attrs.frozen(kw_only=True)
class ColumnMap:
    """Where a row's prompt and metadata are (``rollout.prompt_key``, ``answer_key``,
    ``metadata_keys``). Unmapped (the config's defaults), a row is a unirl prompt line: the
    fields of `FIELDS` and no others. Mapped, the prompt is the ``prompt_key`` column (text, a
    list of chat messages, or token ids), ``answer_key`` becomes ``metadata["answer"]``, each
    of ``metadata_keys`` its own metadata entry, and other columns are ignored (a published
    dataset carries columns a run does not use)."""

    prompt_key: str
    answer_key: str | None
    metadata_keys: tuple[str, ...]

    @classmethod
    def of(cls, rollout: RolloutConfig) -> ColumnMap:
        return cls(
            prompt_key=rollout.prompt_key,
            answer_key=rollout.answer_key,
            metadata_keys=rollout.metadata_keys,
        )

    @property
    def mapped(self) -> bool:
        defaults = ColumnMap.of(RolloutConfig())
        return self != defaults


@attrs.frozen(kw_only=True)
class PromptRecord:
    """One row of a prompt dataset, checked: text, chat messages or ids, and the metadata;
    ``where`` names the row (``FILE line N`` / ``FILE row N``)."""

    line: int
    where: str
    text: str | None
    tokens: tuple[int, ...] | None
    metadata: dict[str, Any]
    messages: tuple[dict[str, str], ...] | None = None


def read_prompt_records(path: Path, columns: ColumnMap) -> list[PromptRecord]:
    """Every prompt of the dataset (JSONL, Parquet or a datasets folder:
    `unirl.rollouts.data.prompt_datasets`), each row checked (`RolloutDataError` names row and
    field)."""
    mapping = columns if columns.mapped else None
    records = [_parse_row(row, where, number, mapping) for where, number, row in iter_rows(path)]
    if not records:
        raise RolloutDataError(
            f"{path}: the prompt file holds no prompts; write one JSON object per line"
        )
    return records


def prompt_records(cfg: UnirlConfig) -> list[PromptRecord]:
    """The records of ``rollout.prompts`` read through the config's column mapping."""
    assert cfg.rollout.prompts is not None  # callers check
    return read_prompt_records(Path(cfg.rollout.prompts), ColumnMap.of(cfg.rollout))


def _parse_row(record: Any, where: str, number: int, mapping: ColumnMap | None) -> PromptRecord:
    """One row, as a unirl prompt line (``mapping`` None) or through the column mapping."""
    if not isinstance(record, dict):
        raise RolloutDataError(
            f'{where}: expected a JSON object such as {{"prompt": "...", "metadata": '
            f'{{"answer": 7}}}}, got {type(record).__name__}'
        )
    if mapping is not None:
        return _parse_mapped(record, where, number, mapping)
    unknown = sorted(set(record) - set(FIELDS))
    if unknown:
        raise RolloutDataError(
            f"{where}: unknown field {unknown[0]!r}; a prompt line holds 'prompt' (text), "
            "'messages' (chat messages) or 'prompt_tokens' (ids), and optionally 'metadata' (an "
            "object, e.g. the answer); a dataset with other columns needs rollout.prompt_key / "
            "answer_key / metadata_keys"
        )
    given = [f for f in ("prompt", "messages", "prompt_tokens") if f in record]
    if len(given) != 1:
        raise RolloutDataError(
            f"{where}: give exactly one of 'prompt' (text), 'messages' (chat messages) and "
            f"'prompt_tokens' (ids), found {_found(given)}"
        )
    text, messages, tokens = _prompt_value(record[given[0]], where, given[0], given[0])
    metadata = record.get("metadata", {})
    if not isinstance(metadata, dict):
        raise RolloutDataError(
            f"{where}: field 'metadata' is {type(metadata).__name__}; give an object such as "
            '{"answer": 7}, or leave it out'
        )
    return PromptRecord(
        line=number, where=where, text=text, tokens=tokens, metadata=metadata, messages=messages
    )


def _row_numbers(wheres: Sequence[str], shown: int = 5) -> str:
    """``lines 3, 9`` (JSONL, 1-based) or ``rows 0, 4 (0-based)`` (Parquet, datasets) of the
    first ``shown`` rows named by their ``where``."""
    numbers = ", ".join(w.rsplit(" ", 1)[-1] for w in wheres[:shown])
    more = " ..." if len(wheres) > shown else ""
    if wheres and wheres[0].rsplit(" ", 2)[-2] == "row":
        return f"rows {numbers}{more} (0-based)"
    return f"lines {numbers}{more}"


def _found(given: Sequence[str]) -> str:
    if not given:
        return "neither"
    return ("both " if len(given) == 2 else "all of ") + " and ".join(repr(g) for g in given)


def _parse_mapped(record: dict, where: str, number: int, columns: ColumnMap) -> PromptRecord:
    wanted = [("rollout.prompt_key", columns.prompt_key)]
    if columns.answer_key is not None:
        wanted.append(("rollout.answer_key", columns.answer_key))
    wanted += [(f"rollout.metadata_keys[{i}]", k) for i, k in enumerate(columns.metadata_keys)]
    for key, column in wanted:
        if isinstance(record, TableRow) and column in record.nulls:
            raise RolloutDataError(
                f"{where}: the cell of column {column!r} ({key}) is empty (null); fill it or "
                "drop the row from the dataset"
            )
        if column not in record:
            raise RolloutDataError(
                f"{where}: no field {column!r} ({key}); the row has {sorted(record)}; set {key} "
                "to one of them"
            )
    value = record[columns.prompt_key]
    if isinstance(value, str):
        kind = "prompt"
    elif isinstance(value, (list, tuple)) and value and all(isinstance(v, dict) for v in value):
        kind = "messages"
    else:
        kind = "prompt_tokens"
    text, messages, tokens = _prompt_value(value, where, columns.prompt_key, kind)
    metadata = {column: record[column] for column in columns.metadata_keys}
    if columns.answer_key is not None:
        metadata["answer"] = record[columns.answer_key]
    return PromptRecord(
        line=number, where=where, text=text, tokens=tokens, metadata=metadata, messages=messages
    )


def _prompt_value(
    value: Any, where: str, field: str, kind: str
) -> tuple[str | None, tuple[dict[str, str], ...] | None, tuple[int, ...] | None]:
    """(text, messages, tokens), one of them set, from the field's value of the given kind."""
    if kind == "prompt":
        if not isinstance(value, str) or not value:
            raise RolloutDataError(
                f"{where}: field {field!r} is {value!r}; give the prompt as a non-empty string"
            )
        return value, None, None
    if kind == "messages":
        return None, check_messages(value, where, field), None
    if (
        not isinstance(value, (list, tuple))
        or not value
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    ):
        raise RolloutDataError(
            f"{where}: field {field!r} must be a non-empty list of token ids "
            f"(integers >= 0){', chat messages or text' if field != 'prompt_tokens' else ''}, "
            f"got {_short(value)}"
        )
    return None, None, tuple(value)


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
    texts += [m["content"] for r in records for m in r.messages or ()]
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
        reward: NamedReward | None,
        *,
        seed: int,
        max_prompt_length: int,
        skip_long_prompts: bool,
        records: Sequence[PromptRecord],
        apply_chat_template: bool,
        system_prompt: str | None,
    ) -> None:
        self.path = Path(path)
        self.tokenizer = tokenizer
        self.reward_fn = reward
        self.seed = seed
        self.apply_chat_template = apply_chat_template
        self.system_prompt = system_prompt
        self.digest = content_digest(self.path)
        chat = apply_chat_template or any(r.messages is not None for r in records)
        if system_prompt is not None and not chat:
            raise ConfigError(
                f"rollout.system_prompt is set, but no prompt of {self.path} goes through the "
                "chat template (every one is text or token ids); set "
                "rollout.apply_chat_template: true to make each text prompt a user message, or "
                "remove rollout.system_prompt"
            )
        self.problems, too_long = self._problems(records, max_prompt_length)
        if too_long and not skip_long_prompts:
            where, length = too_long[0]
            raise RolloutDataError(
                f"{where}: the prompt is {length} tokens, longer than "
                f"model.max_seq_len - rollout.max_new_tokens = {max_prompt_length}; shorten it, "
                "raise model.max_seq_len, lower rollout.max_new_tokens, or set "
                "rollout.skip_long_prompts: true to drop such prompts"
            )
        if too_long:
            logger.warning(
                "%s: %d of %d prompts are longer than model.max_seq_len - rollout.max_new_tokens "
                "= %d tokens and are skipped (rollout.skip_long_prompts): %s",
                self.path, len(too_long), len(records), max_prompt_length,
                _row_numbers([w for w, _ in too_long]),
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
            where = r.where
            messages = r.messages
            if messages is None and r.text is not None and self.apply_chat_template:
                messages = ({"role": "user", "content": r.text},)
            if messages is not None:
                tokens = chat_prompt_ids(
                    self.tokenizer.hf, messages, system_prompt=self.system_prompt, where=where
                )
                text = self.tokenizer.hf.decode(tokens)  # what the policy sees, template included
            elif r.tokens is not None:
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
                tokens, text = self._encode(r.text, where), r.text
            if len(tokens) > limit:
                too_long.append((where, len(tokens)))
                continue
            problems.append(
                Problem(prompt_tokens=tokens, prompt_text=text, metadata=r.metadata, origin=where)
            )
        return problems, too_long

    def _encode(self, text: str, where: str) -> list[int]:
        """The prompt's ids; a tokenizer that cannot encode it (a character outside a word-level
        vocabulary without an unknown token, as the tiny examples' character tokenizer) is a
        `RolloutDataError` naming the prompt, not the tokenizer's traceback."""
        try:
            return list(self.tokenizer.encode_prompt(text))
        except Exception as exc:
            raise RolloutDataError(
                f"{where}: the tokenizer cannot encode the prompt {text[:60]!r} "
                f"({type(exc).__name__}: {exc}); write prompts in the characters or words its "
                "vocabulary holds, or use the model's own tokenizer (model.path)"
            ) from None

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
        if self.reward_fn is None:
            raise RunError(
                "rollout.prompts has no rollout.reward (rollout.environment scores its episodes), "
                "but a response needs the task's reward here; set rollout.reward"
            )
        return self.reward_fn(
            [p.prompt_text for p in problems],
            [self.tokenizer.decode(r) for r in responses],
            [p.metadata for p in problems],
            prompt_tokens=[p.prompt_tokens for p in problems],
            response_tokens=responses,
            origins=[p.origin for p in problems],
        )

    def reward_wait_bound(self, samples: int) -> tuple[float, str] | None:
        """`RewardRun.wait_bound` of the reward (None without workers with a time limit)."""
        if self.reward_fn is None or self.reward_fn.run is None:
            return None
        return self.reward_fn.run.wait_bound(samples)

    def close(self) -> None:
        """Stop the reward's worker processes (``rollout.reward_workers``), if any."""
        if self.reward_fn is not None:
            self.reward_fn.close()

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


def make_prompt_task(cfg: UnirlConfig) -> PromptFileTask:
    """The task of ``rollout.prompts`` and ``rollout.reward`` (file read, tokenized, checked)."""
    r = cfg.rollout
    # the config checks both, unless an environment scores the episodes (no reward function)
    assert r.prompts is not None and (r.reward is not None or r.environment is not None)
    reward = (
        None if r.reward is None else NamedReward(r.reward, r.reward_options, RewardRun.of(cfg))
    )
    records = prompt_records(cfg)
    return PromptFileTask(
        r.prompts,
        prompt_tokenizer(cfg, records),
        reward,
        seed=cfg.train.seed,
        max_prompt_length=cfg.model.max_seq_len - r.max_new_tokens,
        skip_long_prompts=r.skip_long_prompts,
        records=records,
        apply_chat_template=r.apply_chat_template,
        system_prompt=r.system_prompt,
    )
