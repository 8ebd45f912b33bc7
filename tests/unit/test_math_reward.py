"""math_answer and exact_match: the extraction rule on hand-written edge cases."""

from fractions import Fraction

import pytest

from unirl.rollouts.rewards.math import (
    exact_match,
    extract_answer,
    gsm8k,
    math_answer,
    reference_answer,
)


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
        # nested braces in a box: the whole box, not its first closing brace
        ("\\boxed{\\frac{3}{4}} then 9", Fraction(3, 4)),
        ("\\boxed{2^{10}}", Fraction(10)),  # no power evaluation: its last number
        ("\\boxed{\\text{\\textbf{12}} apples}", Fraction(12)),
        ("\\boxed{5", Fraction(5)),  # an unclosed box is no box: the last number
        # fractions
        ("\\frac{3}{4}", Fraction(3, 4)),
        ("\\dfrac{12}{8}", Fraction(3, 2)),
        ("\\tfrac{1}{3}", Fraction(1, 3)),
        ("\\frac34", Fraction(3, 4)),
        ("\\frac{1.5}{2}", Fraction(3, 4)),
        ("-\\frac{3}{4}", Fraction(-3, 4)),
        ("\\frac{-3}{4}", Fraction(-3, 4)),
        ("\\frac{ 3 }{ 4 }", Fraction(3, 4)),
        ("\\frac{3}{0}", None),
        # negatives and signs
        ("\u2212 7", Fraction(7)),  # a unicode minus, then a space: no sign (as "- 7")
        ("\u22127", Fraction(-7)),
        ("$-12$", Fraction(-12)),
        # thousands separators, plain and LaTeX
        ("$1,000,000$", Fraction(1000000)),
        ("1{,}234", Fraction(1234)),
        ("1\\,234", Fraction(1234)),
        ("$\\$18.50$", Fraction(37, 2)),
        # simple LaTeX
        ("$\\left( -\\frac{1}{2} \\right)$", Fraction(-1, 2)),
        ("x = \\!-\\!5", Fraction(-5)),
        ("50\\%", Fraction(50)),
        ("\\boxed{\\dfrac{7}{2}}", Fraction(7, 2)),
        ("#### \\$1,250", Fraction(1250)),
        # negatives inside a box, and a box after a plain fraction
        ("\\boxed{-5}", Fraction(-5)),
        ("\\boxed{-\\frac{1}{2}}", Fraction(-1, 2)),
        ("3/4 then \\boxed{\\frac{5}{6}}", Fraction(5, 6)),
        ("$x = -\\dfrac{9}{3}$", Fraction(-3)),
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


def test_gsm8k_reads_the_number_after_hashes_in_the_reference():
    solution = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n48+24 = <<48+24=72>>72\n#### 72"
    responses = [
        "48 + 24 = 72 clips\n#### 72",  # GSM8K style
        "so she sold \\boxed{72} clips",  # a box
        "The answer is 72.",  # the last number
        "#### 71",
        "72 #### 70",  # after ####: 70
        "no idea",
    ]
    got = gsm8k([""] * 6, responses, [{"answer": solution}] * 6)
    assert got == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    big = [{"answer": "... #### 1,600"}]
    assert gsm8k([""], ["1600"], big) == [1.0]
    with pytest.raises(ValueError, match=r"has no '####'"):
        gsm8k([""], ["72"], [{"answer": "72"}])
    with pytest.raises(ValueError, match=r"metadata has no 'answer'.*rollout.answer_key"):
        gsm8k([""], ["72"], [{"question": "q"}])


def test_reference_answers_in_latex():
    assert reference_answer({"answer": "\\frac{3}{4}"}, "answer") == Fraction(3, 4)
    assert reference_answer({"answer": "$-\\dfrac{1}{2}$"}, "answer") == Fraction(-1, 2)
    assert math_answer([""], ["\\boxed{0.75}"], [{"answer": "\\frac{3}{4}"}]) == [1.0]
