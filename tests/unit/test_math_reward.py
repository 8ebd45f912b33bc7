"""math_answer and exact_match: the extraction rule on hand-written edge cases."""

from fractions import Fraction

import pytest

from unirl.rollouts.math_reward import exact_match, extract_answer, math_answer, reference_answer


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("7", Fraction(7)),
        ("the answer is 42.", Fraction(42)),  # a sentence's full stop is not a decimal point
        ("first 3 then 15", Fraction(15)),  # the last number counts
        ("1,234 apples", Fraction(1234)),  # thousands commas
        ("12,34", Fraction(34)),  # not a thousands group: two numbers, the last is 34
        ("x = -7", Fraction(-7)),  # a minus after a space is a sign
        ("3-4", Fraction(4)),  # after a digit it is an operator: 3, then 4
        ("a-3", Fraction(3)),  # after a letter too
        ("(-3)", Fraction(-3)),
        ("2.50", Fraction(5, 2)),
        ("3/4", Fraction(3, 4)),
        ("1.2.3", Fraction(6, 5)),  # 1.2, then ".3" is no number (it starts at a point)
        ("\\boxed{17} and then 3", Fraction(17)),  # a box wins over later numbers
        ("\\boxed{1} \\boxed{2,000}", Fraction(2000)),  # the last box
        ("work 5 #### 8, then 9", Fraction(9)),  # after ####: its last number
        ("12 ####", None),  # nothing after ####
        ("no number here", None),
        ("", None),
        ("5/0", None),  # no value
        ("007", Fraction(7)),
    ],
)
def test_extract_answer(response, expected):
    assert extract_answer(response) == expected


def test_math_answer_exact_numeric_match():
    responses = ["12", "12.0", "so 12.", "13", "twelve", "-12", "\\boxed{12}", "1/2"]
    metadata = [{"answer": 12}] * 7 + [{"answer": "0.5"}]
    # Hand-checked: 12, 12.0 and "so 12." equal 12; 13, no number and -12 do not; the box
    # holds 12; 1/2 equals the string answer 0.5.
    got = math_answer([""] * 8, responses, metadata, prompt_tokens=[], response_tokens=[])
    assert got == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0]


def test_reference_answer_forms_and_errors():
    assert reference_answer({"answer": 0.1}, "answer") == Fraction(1, 10)  # not binary 0.1
    assert reference_answer({"answer": " 1,250 "}, "answer") == Fraction(1250)
    assert reference_answer({"answer": "-3"}, "answer") == Fraction(-3)
    assert reference_answer({"sum": 4}, "sum") == Fraction(4)
    with pytest.raises(ValueError, match=r"metadata has no 'answer'.*keys: \['sum'\]"):
        reference_answer({"sum": 4}, "answer")
    for bad in ("12 apples", "abc", True, "1/0"):
        with pytest.raises(ValueError, match=r"is not one number"):
            reference_answer({"answer": bad}, "answer")


def test_exact_match_strips_whitespace_only():
    got = exact_match(["", ""], [" 42\n", "42."], [{"answer": 42}, {"answer": 42}])
    assert got == [1.0, 0.0]
    assert exact_match([""], ["Paris"], [{"city": "Paris"}], answer_key="city") == [1.0]
    with pytest.raises(ValueError, match=r"metadata has no 'answer'"):
        exact_match([""], ["x"], [{}])
