"""Built-in tasks with verifiable rewards, and the registry that names them.

A task draws problems from a seeded `random.Random` (the same seed gives the same prompts) and
scores a response by comparing it with the one right answer, so a run needs no reward model and
no download. Rewards lie in [0, 1] with partial credit (`positional_reward`), which gives GRPO a
signal before the policy solves anything exactly.

    task = make_task("reverse_digits")  # or "add_small", "repeat_digit", "package.module:factory"
    problem = task.sample_problem(random.Random(0))
    task.reward(problem, response_tokens)        # 1.0 only for the exact answer ended by <eos>

Add a task with ``register_task("name", factory)`` (``factory()`` returns a `Task`), e.g. a
longer reversal: ``register_task("reverse_long", lambda: ReverseDigits(min_digits=5,
max_digits=8))``, then ``rollout.task: reverse_long``.

Two optional extensions, which a rollout source reaches through `task_rewards`,
`task_state` and `load_task_state` (so a task without them works unchanged):
`BatchRewardTask.rewards` scores a whole rollout in one call (a prompt file's named reward
function is batched), and `StatefulTask.state_dict` / ``load_state_dict`` carry a task's own
stream position through a checkpoint (a prompt file's cursor).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from unirl.core.errors import ConfigError
from unirl.core.imports import import_callable
from unirl.core.registry import Registry, same_callable
from unirl.rollouts.data.tokenizer import EOS_ID, CharTokenizer

DIGITS = "0123456789"


@attrs.frozen(kw_only=True)
class Problem:
    """One prompt and its answer. ``target_tokens`` ends with ``<eos>``; a prompt read from a
    file may have no target tokens (its reward function reads ``metadata``, e.g. the reference
    answer) and names its place in ``origin`` ("FILE line N")."""

    prompt_tokens: tuple[int, ...] = attrs.field(converter=tuple)
    target_tokens: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    prompt_text: str
    target_text: str = ""
    metadata: Mapping[str, Any] = attrs.field(factory=dict)
    origin: str = ""


@runtime_checkable
class TaskTokenizer(Protocol):
    """What a rollout source needs from a task's tokenizer: `CharTokenizer`, or a Hugging Face
    tokenizer through `unirl.rollouts.data.hf_tokenizer.HFTokenizer`."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def special_token_ids(self) -> dict[str, int]: ...


@runtime_checkable
class Task(Protocol):
    """What a rollout source needs from a task."""

    name: str
    tokenizer: TaskTokenizer
    # Bounds over every problem the task can draw (the answer counts its <eos>), checked
    # against rollout.max_new_tokens and model.max_seq_len before a run starts.
    max_prompt_length: int
    max_target_length: int

    def sample_problem(self, rng: random.Random) -> Problem: ...

    def reward(self, problem: Problem, response_tokens: Sequence[int]) -> float: ...


@runtime_checkable
class BatchRewardTask(Protocol):
    """A task that scores many responses in one call (one reward per response, in order)."""

    def rewards(
        self, problems: Sequence[Problem], responses: Sequence[Sequence[int]]
    ) -> list[float]: ...


@runtime_checkable
class BoundedRewardTask(Protocol):
    """A task whose rewards rank 0 computes within a bound of their own (reward worker
    processes, each sample within ``rollout.reward_timeout_s``)."""

    def reward_wait_bound(self, samples: int) -> tuple[float, str] | None: ...


def reward_wait_bound(task: Task, samples: int) -> tuple[float, str] | None:
    """How long the other ranks wait for rank 0 to score ``samples`` samples of ``task``
    (seconds, and how an error names that bound); None: as long as rank 0 scores (a reward in
    the training process, which nothing there can stop either)."""
    return task.reward_wait_bound(samples) if isinstance(task, BoundedRewardTask) else None


@runtime_checkable
class StatefulTask(Protocol):
    """A task whose problem stream has a position of its own (beyond the rng it is given),
    saved with the rollout source's state so a resumed run draws the problems it would have."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def task_rewards(
    task: Task, problems: Sequence[Problem], responses: Sequence[Sequence[int]]
) -> list[float]:
    """The reward of each response (``responses[i]`` answers ``problems[i]``): one batched call
    when the task has `BatchRewardTask.rewards`, else `Task.reward` per response."""
    if isinstance(task, BatchRewardTask):
        return task.rewards(problems, responses)
    return [task.reward(p, r) for p, r in zip(problems, responses, strict=True)]


@runtime_checkable
class ClosableTask(Protocol):
    """A task holding something to release when the run ends (reward worker processes)."""

    def close(self) -> None: ...


def close_task(task: Task) -> None:
    """Release what the task holds (nothing for a task without `ClosableTask.close`)."""
    if isinstance(task, ClosableTask):
        task.close()


def task_state(task: Task) -> dict[str, Any] | None:
    """The task's own stream state for a checkpoint; None for a task without one."""
    return task.state_dict() if isinstance(task, StatefulTask) else None


def load_task_state(task: Task, state: Mapping[str, Any] | None) -> None:
    """Restore what `task_state` returned (None: nothing to restore)."""
    if isinstance(task, StatefulTask):
        if state is None:
            raise ConfigError(
                f"the checkpoint holds no stream state for task {task.name!r}; resume with the "
                "rollout settings the run started with"
            )
        task.load_state_dict(state)


def positional_reward(response_tokens: Sequence[int], target_tokens: Sequence[int]) -> float:
    """Fraction of answer positions the response gets right, the final ``<eos>`` included.

    ``reward = #{i < len(target) : response[i] == target[i]} / len(target)``, reading the
    response up to its first ``<eos>``. So the exact answer ended by ``<eos>`` scores 1; the
    right digits without ``<eos>`` (cut off by max_new_tokens) or followed by an extra digit
    score ``n / (n + 1)``; a response that starts wrong keeps credit for later positions.
    """
    response = [int(t) for t in response_tokens]
    if EOS_ID in response:
        response = response[: response.index(EOS_ID) + 1]
    correct = sum(1 for r, t in zip(response, target_tokens) if r == t)
    return correct / len(target_tokens)


@attrs.frozen
class ReverseDigits:
    """Prompt ``<bos> d1 .. dn <sep>``, answer ``dn .. d1 <eos>``; n uniform in
    [min_digits, max_digits], digits uniform 0-9 (leading zeros allowed)."""

    min_digits: int = 2
    max_digits: int = 4
    name: str = "reverse_digits"
    tokenizer: CharTokenizer = attrs.field(factory=lambda: CharTokenizer(DIGITS))

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits:
            raise ConfigError(
                f"ReverseDigits: need 1 <= min_digits <= max_digits, got "
                f"min_digits={self.min_digits}, max_digits={self.max_digits}"
            )

    @property
    def max_prompt_length(self) -> int:
        return self.max_digits + 2  # <bos> digits <sep>

    @property
    def max_target_length(self) -> int:
        return self.max_digits + 1  # digits <eos>

    def sample_problem(self, rng: random.Random) -> Problem:
        n = rng.randint(self.min_digits, self.max_digits)
        digits = "".join(rng.choice(DIGITS) for _ in range(n))
        answer = digits[::-1]
        return Problem(
            prompt_tokens=self.tokenizer.encode(digits, bos=True, sep=True),
            target_tokens=self.tokenizer.encode(answer, eos=True),
            prompt_text=digits,
            target_text=answer,
        )

    def reward(self, problem: Problem, response_tokens: Sequence[int]) -> float:
        return positional_reward(response_tokens, problem.target_tokens)


@attrs.frozen
class AddSmall:
    """Prompt ``<bos> a + b <sep>``, answer the decimal digits of ``a + b`` then ``<eos>``;
    a and b uniform in [0, max_operand] (default: single and double digits)."""

    max_operand: int = 99
    name: str = "add_small"
    tokenizer: CharTokenizer = attrs.field(factory=lambda: CharTokenizer(DIGITS + "+"))

    def __attrs_post_init__(self) -> None:
        if self.max_operand < 1:
            raise ConfigError(f"AddSmall: max_operand must be >= 1, got {self.max_operand}")

    @property
    def max_prompt_length(self) -> int:
        return 2 * len(str(self.max_operand)) + 3  # <bos> a + b <sep>

    @property
    def max_target_length(self) -> int:
        return len(str(2 * self.max_operand)) + 1

    def sample_problem(self, rng: random.Random) -> Problem:
        a = rng.randint(0, self.max_operand)
        b = rng.randint(0, self.max_operand)
        question, answer = f"{a}+{b}", str(a + b)
        return Problem(
            prompt_tokens=self.tokenizer.encode(question, bos=True, sep=True),
            target_tokens=self.tokenizer.encode(answer, eos=True),
            prompt_text=question,
            target_text=answer,
        )

    def reward(self, problem: Problem, response_tokens: Sequence[int]) -> float:
        # Left-aligned digit comparison: a sum of the wrong length is wrong from its first digit.
        return positional_reward(response_tokens, problem.target_tokens)


@attrs.frozen
class RepeatDigit:
    """Prompt ``<bos> d c1 .. ck <sep>``, answer the digit d written c times then ``<eos>``:
    d uniform 0-9, c uniform in [min_count, max_count], written with as many digits as
    ``max_count`` has (zero-padded), so every prompt has the same length.

    Answers run from tens to hundreds of tokens (the default: 10-250), so a batch of responses
    varies widely in length: the workload where packing sequences (not padding them) pays.
    """

    min_count: int = 10
    max_count: int = 250
    name: str = "repeat_digit"
    tokenizer: CharTokenizer = attrs.field(factory=lambda: CharTokenizer(DIGITS))

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.min_count <= self.max_count:
            raise ConfigError(
                f"RepeatDigit: need 1 <= min_count <= max_count, got "
                f"min_count={self.min_count}, max_count={self.max_count}"
            )

    @property
    def max_prompt_length(self) -> int:
        return len(str(self.max_count)) + 3  # <bos> d count <sep>

    @property
    def max_target_length(self) -> int:
        return self.max_count + 1  # d * count <eos>

    def sample_problem(self, rng: random.Random) -> Problem:
        d = rng.choice(DIGITS)
        count = rng.randint(self.min_count, self.max_count)
        question = d + str(count).zfill(len(str(self.max_count)))
        answer = d * count
        return Problem(
            prompt_tokens=self.tokenizer.encode(question, bos=True, sep=True),
            target_tokens=self.tokenizer.encode(answer, eos=True),
            prompt_text=question,
            target_text=answer,
        )

    def reward(self, problem: Problem, response_tokens: Sequence[int]) -> float:
        return positional_reward(response_tokens, problem.target_tokens)


# The tool call of task tool_lookup (its environment, hidden_number, answers it).
TOOL_CALL = "c"


@attrs.frozen
class ToolLookup:
    """Problems for the ``hidden_number`` environment (`unirl.rollouts.environments.hidden_number`): the prompt ``<bos> ? <sep>``, a secret digit in metadata."""

    name: str = "tool_lookup"
    tokenizer: CharTokenizer = attrs.field(factory=lambda: CharTokenizer(DIGITS + "?=" + TOOL_CALL))

    @property
    def max_prompt_length(self) -> int:
        return 3

    @property
    def max_target_length(self) -> int:
        return 2  # the secret and <eos> (the call turn is shorter)

    def sample_problem(self, rng: random.Random) -> Problem:
        secret = rng.choice(DIGITS)
        return Problem(
            prompt_tokens=self.tokenizer.encode("?", bos=True, sep=True),
            target_tokens=self.tokenizer.encode(secret, eos=True),
            prompt_text="?",
            target_text=secret,
            metadata={"secret": secret},
        )

    def reward(self, problem: Problem, response_tokens: Sequence[int]) -> float:
        """The single-turn score (a run without the environment): the exact answer."""
        return float(list(response_tokens) == list(problem.target_tokens))


# -- registry ------------------------------------------------------------------------------

TaskFactory = Callable[..., Task]
TASKS: Registry[TaskFactory] = Registry("task", key="rollout.task", same=same_callable)


def register_task(name: str, factory: TaskFactory) -> None:
    """Make ``rollout.task: name`` build ``factory()``. Re-registering the same factory is a
    no-op (a reloaded module); a different one under a taken name is an error."""
    TASKS.register(name, factory)


def registered_tasks() -> list[str]:
    return TASKS.names()


def make_task(name: str, options: Mapping[str, Any] | None = None) -> Task:
    """The task registered as ``name`` (``rollout.task``), or ``factory()`` for a name written
    ``"package.module:factory"``, built with ``options`` (``rollout.task_options``, e.g.
    ``{max_digits: 3}``) as keyword arguments."""
    if ":" in name:
        factory = _import_factory(name)
    else:
        factory = TASKS.get(name, hint="or a custom task factory as 'package.module:factory'")
    try:
        task = factory(**dict(options or {}))
    except TypeError as exc:
        raise ConfigError(
            f"rollout.task_options={dict(options or {})!r} do not fit task {name!r}: {exc}"
        ) from None
    if not isinstance(task, Task):
        raise ConfigError(
            f"rollout.task={name!r}: the factory returned {type(task).__name__}, which lacks the "
            "Task attributes (name, tokenizer, max_prompt_length, max_target_length, "
            "sample_problem, reward)"
        )
    return task


def _import_factory(spec: str) -> TaskFactory:
    return import_callable(spec, key="rollout.task", what="a custom task factory")


register_task("reverse_digits", ReverseDigits)
register_task("add_small", AddSmall)
register_task("repeat_digit", RepeatDigit)
register_task("tool_lookup", ToolLookup)
