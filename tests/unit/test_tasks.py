"""Built-in tasks and their tokenizer: hand-computed rewards, deterministic prompts, registry."""

import random

import pytest

from unirl.core.errors import ConfigError
from unirl.rollouts.data.tasks import (
    AddSmall,
    Problem,
    RepeatDigit,
    ReverseDigits,
    make_task,
    positional_reward,
    register_task,
    registered_tasks,
)
from unirl.rollouts.data.tokenizer import CharTokenizer

# Ids: <pad> 0, <bos> 1, <eos> 2, <sep> 3, then '0' -> 4, ..., '9' -> 13, '+' -> 14.
PAD, BOS, EOS, SEP = 0, 1, 2, 3


def digit(d: int) -> int:
    return 4 + d


def make_long_reverse() -> ReverseDigits:
    """A factory named as 'tests.unit.test_tasks:make_long_reverse' in a test below."""
    return ReverseDigits(min_digits=6, max_digits=7)


# -- tokenizer ------------------------------------------------------------------------------


def test_tokenizer_ids_and_vocab():
    tok = CharTokenizer("0123456789+")
    assert tok.vocab_size == 15  # 4 special + 10 digits + '+'
    assert CharTokenizer("0123456789").vocab_size == 14
    assert tok.encode("12+7", bos=True, sep=True) == [BOS, digit(1), digit(2), 14, digit(7), SEP]
    assert tok.encode("90", eos=True) == [digit(9), digit(0), EOS]
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.sep_id) == (PAD, BOS, EOS, SEP)
    assert tok.special_token_ids() == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def test_tokenizer_round_trip_and_specials():
    tok = CharTokenizer("0123456789+")
    for text in ["0", "9876543210", "12+34", "+"]:
        assert tok.decode(tok.encode(text, bos=True, sep=True)) == text
        assert tok.decode(tok.encode(text, eos=True)) == text
    assert tok.decode([BOS, digit(3), SEP, digit(4), EOS], skip_special=False) == (
        "<bos>3<sep>4<eos>"
    )
    # An id the model may emit beyond the tokenizer's vocabulary still decodes.
    assert tok.decode([digit(1), 15, 31]) == "1<unk:15><unk:31>"


def test_tokenizer_rejects_bad_alphabets_and_characters():
    with pytest.raises(ValueError, match=r"'x' at position 1"):
        CharTokenizer("0123456789").encode("1x")
    with pytest.raises(ValueError, match=r"repeats \['1'\]"):
        CharTokenizer("0112")
    with pytest.raises(ValueError, match=r"<= 256"):
        CharTokenizer("".join(map(chr, range(300, 553))))  # 253 + 4 special = 257
    with pytest.raises(ValueError, match=r"empty"):
        CharTokenizer("")


# -- rewards --------------------------------------------------------------------------------


def reverse_problem_123() -> Problem:
    # Prompt "123"; answer "321" then <eos>: target ids [7, 6, 5, 2].
    return Problem(
        prompt_tokens=[BOS, digit(1), digit(2), digit(3), SEP],
        target_tokens=[digit(3), digit(2), digit(1), EOS],
        prompt_text="123",
        target_text="321",
    )


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ([digit(3), digit(2), digit(1), EOS], 1.0),  # exact and terminated
        ([digit(3), digit(9), digit(1), EOS], 3 / 4),  # one wrong digit: 3 of 4 positions
        ([digit(3), digit(2), digit(1)], 3 / 4),  # no <eos> (budget ran out): 3 of 4
        ([digit(3), digit(2), digit(1), digit(1), EOS], 3 / 4),  # too long: pos 3 is '1' != eos
        ([digit(3), digit(2), EOS], 2 / 4),  # too short: pos 2 is eos != '1'
        ([digit(1), digit(2), digit(3), EOS], 2 / 4),  # not reversed: '2' at pos 1 and eos match
        ([EOS], 0.0),  # empty answer
        ([digit(9)] * 4, 0.0),  # garbage
        ([100, 200], 0.0),  # ids outside the vocabulary
        # Tokens after the first <eos> are not read: [3, eos] scores pos 0 only (1 / 4), although
        # the '1' and <eos> after it would line up with positions 2 and 3.
        ([digit(3), EOS, digit(1), EOS], 1 / 4),
    ],
)
def test_reverse_digits_rewards(response, expected):
    task = ReverseDigits()
    assert task.reward(reverse_problem_123(), response) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ([digit(1), digit(9), EOS], 1.0),  # 12 + 7 = 19
        ([digit(1), digit(8), EOS], 2 / 3),  # "18": first digit and <eos> right
        ([digit(1), digit(9)], 2 / 3),  # unterminated
        ([digit(1), digit(9), digit(0), EOS], 2 / 3),  # "190"
        ([digit(9), digit(1), EOS], 1 / 3),  # digits swapped, <eos> in place
        ([EOS], 0.0),
    ],
)
def test_add_small_rewards(response, expected):
    task = AddSmall()
    problem = Problem(
        prompt_tokens=[BOS, digit(1), digit(2), 14, digit(7), SEP],
        target_tokens=[digit(1), digit(9), EOS],
        prompt_text="12+7",
        target_text="19",
    )
    assert task.reward(problem, response) == pytest.approx(expected, abs=1e-12)


def test_positional_reward_is_in_unit_interval():
    rng = random.Random(1)
    target = [digit(4), digit(2), EOS]
    for _ in range(200):
        response = [rng.randrange(0, 16) for _ in range(rng.randint(1, 6))]
        assert 0.0 <= positional_reward(response, target) <= 1.0


# -- prompts --------------------------------------------------------------------------------


def test_reverse_digits_prompts_are_deterministic_and_correct():
    task = ReverseDigits(min_digits=2, max_digits=4)
    draws = [task.sample_problem(random.Random(7)) for _ in range(2)]
    assert draws[0] == draws[1]
    a = [task.sample_problem(rng) for rng in [random.Random(7)] for _ in range(50)]
    b = [task.sample_problem(rng) for rng in [random.Random(7)] for _ in range(50)]
    c = [task.sample_problem(rng) for rng in [random.Random(8)] for _ in range(50)]
    assert a == b and a != c
    lengths = set()
    for p in a:
        prompt = list(p.prompt_tokens)
        assert prompt[0] == BOS and prompt[-1] == SEP
        digits = [t - 4 for t in prompt[1:-1]]
        assert all(0 <= d <= 9 for d in digits)
        lengths.add(len(digits))
        # The answer, computed here from the prompt ids: the digits reversed, then <eos>.
        assert list(p.target_tokens) == [digit(d) for d in reversed(digits)] + [EOS]
        assert p.prompt_text == "".join(map(str, digits))
        assert p.target_text == p.prompt_text[::-1]
        assert len(prompt) <= task.max_prompt_length
        assert len(p.target_tokens) <= task.max_target_length
    assert lengths == {2, 3, 4}


def test_add_small_prompts_are_correct():
    task = AddSmall(max_operand=99)
    rng = random.Random(3)
    for _ in range(100):
        p = task.sample_problem(rng)
        a_text, b_text = p.prompt_text.split("+")
        a, b = int(a_text), int(b_text)
        assert 0 <= a <= 99 and 0 <= b <= 99
        assert p.target_text == str(a + b)
        tok = CharTokenizer("0123456789+")
        assert list(p.prompt_tokens) == [BOS, *tok.encode(p.prompt_text), SEP]
        assert list(p.target_tokens) == [digit(int(c)) for c in str(a + b)] + [EOS]
        assert len(p.prompt_tokens) <= task.max_prompt_length == 7  # <bos> 9 9 + 9 9 <sep>
        assert len(p.target_tokens) <= task.max_target_length == 4  # 198 <eos>


def test_task_constructor_checks():
    with pytest.raises(ConfigError, match=r"min_digits=5, max_digits=3"):
        ReverseDigits(min_digits=5, max_digits=3)
    with pytest.raises(ConfigError, match=r"max_operand must be >= 1, got 0"):
        AddSmall(max_operand=0)


# -- registry -------------------------------------------------------------------------------


def test_registry_builtins_and_unknown_names():
    assert {"reverse_digits", "add_small"} <= set(registered_tasks())
    assert isinstance(make_task("reverse_digits"), ReverseDigits)
    assert isinstance(make_task("add_small"), AddSmall)
    with pytest.raises(
        ConfigError, match=r"rollout.task='reverse_digit'.*did you mean 'reverse_digits'"
    ):
        make_task("reverse_digit")


def test_register_custom_task_and_module_path():
    register_task("test_reverse_long", make_long_reverse)
    register_task("test_reverse_long", make_long_reverse)  # the same factory again: fine
    assert make_task("test_reverse_long").max_digits == 7
    with pytest.raises(ConfigError, match=r"already registered"):
        register_task("test_reverse_long", lambda: ReverseDigits())
    task = make_task("tests.unit.test_tasks:make_long_reverse")
    assert (task.min_digits, task.max_digits) == (6, 7)
    with pytest.raises(ConfigError, match=r"cannot import module 'no_such_module_xyz'"):
        make_task("no_such_module_xyz:factory")
    with pytest.raises(ConfigError, match=r"has no callable 'missing'"):
        make_task("tests.unit.test_tasks:missing")
    with pytest.raises(ConfigError, match=r"returned int"):
        make_task("tests.unit.test_tasks:digit_count")


def digit_count() -> int:
    return 10


def test_task_options_reach_the_factory():
    from unirl.core.errors import ConfigError
    from unirl.rollouts import make_task

    task = make_task("reverse_digits", {"min_digits": 2, "max_digits": 3})
    # <bos> 3 digits <sep> = 5 prompt tokens; 3 digits + <eos> = 4 answer tokens
    assert (task.max_prompt_length, task.max_target_length) == (5, 4)
    with pytest.raises(ConfigError, match=r"rollout.task_options=\{'digits': 3\} do not fit"):
        make_task("reverse_digits", {"digits": 3})


def test_repeat_digit_prompts_answers_and_reward():
    task = make_task("repeat_digit", {"min_count": 3, "max_count": 120})
    assert isinstance(task, RepeatDigit)
    assert (task.max_prompt_length, task.max_target_length) == (6, 121)
    rng = random.Random(0)
    problems = [task.sample_problem(rng) for _ in range(200)]
    for p in problems:
        # <bos> d c c c <sep>: the count zero-padded to 3 digits, so every prompt has 6 tokens
        d, count = p.prompt_text[0], int(p.prompt_text[1:])
        assert len(p.prompt_text) == 4 and 3 <= count <= 120
        assert p.prompt_tokens == (
            BOS,
            digit(int(d)),
            *(digit(int(c)) for c in p.prompt_text[1:]),
            SEP,
        )
        assert p.target_tokens == (digit(int(d)),) * count + (EOS,)
    counts = {int(p.prompt_text[1:]) for p in problems}
    assert min(counts) < 20 and max(counts) > 100  # answers from tens to a hundred tokens
    # "7" x 4: four digits right, <eos> missing -> 4/5; with <eos> 5/5; "7 7 <eos>" -> 2/5
    p = Problem(prompt_tokens=(BOS, digit(7), digit(0), digit(0), digit(4), SEP),
                target_tokens=(digit(7),) * 4 + (EOS,), prompt_text="7004", target_text="7777")  # fmt: skip
    assert task.reward(p, [digit(7)] * 4) == pytest.approx(4 / 5)
    assert task.reward(p, [digit(7)] * 4 + [EOS]) == 1.0
    assert task.reward(p, [digit(7), digit(7), EOS]) == pytest.approx(2 / 5)
    with pytest.raises(ConfigError, match="min_count"):
        RepeatDigit(min_count=5, max_count=4)
