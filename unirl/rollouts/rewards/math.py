"""Rewards that check a response's final answer against the prompt's reference answer
(``metadata["answer"]``): ``math_answer`` (exact numeric match), ``gsm8k`` (the reference is a
GSM8K solution ending ``#### 42``) and ``exact_match`` (text).

The final answer of a response (`extract_answer`) is read in this order:

1. the content of the last ``\\boxed{...}``, if the response has one (braces inside it may
   nest: ``\\boxed{\\frac{3}{4}}``);
2. else the text after the last ``####`` (the GSM8K convention), if it has one;
3. else the whole response;

that text is cleared of simple LaTeX (`strip_latex`: ``$``, ``\\left`` / ``\\right``, the
spacing commands ``\\!`` ``\\,`` ``\\;`` ``\\:``, ``\\text{..}`` and ``\\mathrm{..}`` kept as
their text, ``{,}`` as a comma, ``\\%`` and the unicode minus ``−``; ``\\frac{a}{b}``,
``\\dfrac``, ``\\tfrac`` and ``\\frac34`` of two numbers become ``a/b``), and within it the
**last number** is taken: an optional minus sign (only where it does not follow a letter or
digit, so ``3-4`` reads as 4), digits with optional thousands commas (``1,234``), an optional
decimal part (``2.50``) or a fraction (``3/4``). ``math_answer`` gives 1.0 when that number
equals the reference exactly (as fractions: ``2.50`` equals ``2.5``, ``0.75`` equals ``3/4``
and ``\\dfrac{3}{4}``; no tolerance) and 0.0 otherwise, including when the response has no
number. The reference is an int, a float (read through its shortest decimal form, so 0.1 is
1/10) or a string holding one number in the same notation (LaTeX cleared the same way).

    math_answer(["2+3?"], ["so the answer is 5"], [{"answer": 5}],
                prompt_tokens=[[]], response_tokens=[[]])   # [1.0]
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any

# A minus sign counts only where it does not follow a letter or digit ("3-4" is 3 then 4);
# a number starts at no digit or point; thousands commas group exactly three digits.
_NUMBER = re.compile(r"(?:(?<![\w.])-)?(?<![\d.])(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+|/\d+)?")
_SIGNED = r"-?\d+(?:\.\d+)?"
# \frac{a}{b} of two plain numbers (after spacing is gone), and the short \frac34.
_FRAC = re.compile(rf"\\[dt]?frac\{{\s*({_SIGNED})\s*\}}\{{\s*({_SIGNED})\s*\}}")
_FRAC_SHORT = re.compile(r"\\[dt]?frac(\d)(\d)")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\{([^{}]*)\}")
_DROP = re.compile(r"\\left|\\right|\\[!,;:]|\\ |\$|\\%|%")


def parse_number(text: str) -> Fraction | None:
    """The exact value of one number written as `extract_answer` reads it, or None."""
    text = text.replace(",", "")
    if "/" in text:
        numerator, denominator = text.split("/")
        return Fraction(int(numerator), int(denominator)) if int(denominator) else None
    return Fraction(text)


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces matched, so they may nest), or None
    when there is none or the last one is not closed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i]
            depth -= 1
    return None


def strip_latex(text: str) -> str:
    """``text`` without the simple LaTeX of the module docstring (fractions of two numbers as
    ``a/b``)."""
    text = text.replace("\u2212", "-").replace("{,}", ",")
    for _ in range(3):  # \text{\textbf{..}} nests a little
        text = _TEXT.sub(r"\1", text)
    text = _DROP.sub("", text)
    text = _FRAC.sub(lambda m: _fraction(m.group(1), m.group(2)), text)
    return _FRAC_SHORT.sub(r"\1/\2", text)


def _fraction(numerator: str, denominator: str) -> str:
    """``a/b`` for the number regex; a decimal part (\\frac{1.5}{2}) is folded in exactly."""
    if "." not in numerator + denominator:
        return f"{numerator}/{denominator}"
    if Fraction(denominator) == 0:
        return f"{numerator}/0"
    value = Fraction(numerator) / Fraction(denominator)
    return f"{value.numerator}/{value.denominator}"


def extract_answer(response: str) -> Fraction | None:
    """The final number of ``response`` by the rule in the module docstring; None if none."""
    boxed = last_boxed(response)
    if boxed is not None:
        text = boxed
    elif "####" in response:
        text = response.rsplit("####", 1)[1]
    else:
        text = response
    numbers = [m.group(0) for m in _NUMBER.finditer(strip_latex(text))]
    return parse_number(numbers[-1]) if numbers else None


def reference_answer(metadata: Mapping[str, Any], key: str) -> Fraction:
    """The prompt's reference answer as an exact number; ValueError names what is wrong."""
    if key not in metadata:
        raise ValueError(
            f"the prompt's metadata has no {key!r} (keys: {sorted(metadata)}); give each prompt "
            f'line "metadata": {{"{key}": ...}}'
        )
    value = metadata[key]
    if isinstance(value, bool):
        value = str(value)  # a bool is not a number: refused below
    if isinstance(value, int):
        return Fraction(value)
    if isinstance(value, float):
        return Fraction(repr(value))
    text = strip_latex(str(value)).strip()
    match = _NUMBER.fullmatch(text)
    number = parse_number(text) if match else None
    if number is None:
        raise ValueError(
            f"metadata {key!r}={value!r} is not one number (write e.g. 42, -3, 2.5, 1,250 or 3/4)"
        )
    return number


def math_answer(
    prompts: Sequence[str],
    responses: Sequence[str],
    metadata: Sequence[Mapping[str, Any]],
    *,
    answer_key: str = "answer",
    **_: Any,
) -> list[float]:
    """1.0 where the response's final number (`extract_answer`) equals
    ``metadata[answer_key]`` exactly, else 0.0."""
    rewards = []
    for response, meta in zip(responses, metadata, strict=True):
        reference = reference_answer(meta, answer_key)
        rewards.append(1.0 if extract_answer(response) == reference else 0.0)
    return rewards


def gsm8k_reference(metadata: Mapping[str, Any], key: str) -> Fraction:
    """The number after the last ``####`` of a GSM8K solution (``metadata[key]``)."""
    if key not in metadata:
        raise ValueError(
            f"the prompt's metadata has no {key!r} (keys: {sorted(metadata)}); map the "
            "dataset's solution column with rollout.answer_key"
        )
    solution = str(metadata[key])
    if "####" not in solution:
        raise ValueError(
            f"metadata {key!r}={_short(solution)} has no '####': a GSM8K solution ends with "
            "'#### <answer>'; use rollout.reward: math_answer for a bare number"
        )
    return reference_answer({key: solution.rsplit("####", 1)[1]}, key)


def gsm8k(
    prompts: Sequence[str],
    responses: Sequence[str],
    metadata: Sequence[Mapping[str, Any]],
    *,
    answer_key: str = "answer",
    **_: Any,
) -> list[float]:
    """GSM8K's reward: 1.0 where the response's final number (`extract_answer`: a box, else
    after ``####``, else its last number) equals the number after ``####`` in the reference
    solution ``metadata[answer_key]``, else 0.0."""
    rewards = []
    for response, meta in zip(responses, metadata, strict=True):
        reference = gsm8k_reference(meta, answer_key)
        rewards.append(1.0 if extract_answer(response) == reference else 0.0)
    return rewards


def _short(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def exact_match(
    prompts: Sequence[str],
    responses: Sequence[str],
    metadata: Sequence[Mapping[str, Any]],
    *,
    answer_key: str = "answer",
    **_: Any,
) -> list[float]:
    """1.0 where the response, stripped of surrounding whitespace, equals
    ``str(metadata[answer_key])`` stripped, else 0.0."""
    rewards = []
    for response, meta in zip(responses, metadata, strict=True):
        if answer_key not in meta:
            raise ValueError(
                f"the prompt's metadata has no {answer_key!r} (keys: {sorted(meta)}); give each "
                f'prompt line "metadata": {{"{answer_key}": ...}}'
            )
        rewards.append(1.0 if response.strip() == str(meta[answer_key]).strip() else 0.0)
    return rewards


def _has_key(metadata: Mapping[str, Any], key: str) -> str:
    if key not in metadata:
        raise ValueError(
            f"the prompt's metadata has no {key!r} (keys: {sorted(metadata)}); map the "
            "dataset's answer column with rollout.answer_key"
        )
    return str(metadata[key])


# How each built-in reward reads a prompt's reference (``metadata[answer_key]``): `unirl check`
# reads every prompt's with it, so a dataset without one fails there, not at the first reward.
REFERENCE_READERS: dict[str, Callable[[Mapping[str, Any], str], object]] = {
    "math_answer": reference_answer,
    "gsm8k": gsm8k_reference,
    "exact_match": _has_key,
}
