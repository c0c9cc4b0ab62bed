"""Reward functions and the registry (failure isolation is the runner's: test_reward_runner.py)."""

from __future__ import annotations

import pytest

import relax_core as rc


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("Paris", "paris", 1.0),
        ("  Paris \n", "Paris", 1.0),
        ("New   York", "new york", 1.0),
        ("Paris.", "Paris", 0.0),
        ("London", "Paris", 0.0),
    ],
)
def test_exact_match(response: str, truth: str, expected: float) -> None:
    assert rc.exact_match_reward(response, truth) == expected


def test_exact_match_case_sensitive() -> None:
    assert rc.exact_match_reward("paris", "Paris", case_sensitive=True) == 0.0


@pytest.mark.parametrize(
    ("response", "letter"),
    [
        ("The answer is (C).", "C"),
        ("Answer: B", "B"),
        ("Answer: **D**", "D"),
        ("I first thought A, but the answer is B", "B"),
        ("\\boxed{A}", "A"),
        ("Between (A) and (D) I pick (D)", "D"),
        ("c", "C"),
        ("(b)", "B"),
        ("The answer is a number", None),
        ("I do not know", None),
        ("The answer is Z", None),
    ],
)
def test_extract_choice(response: str, letter: str | None) -> None:
    assert rc.extract_choice(response, letters="ABCD") == letter


def test_multiple_choice_reward() -> None:
    assert rc.multiple_choice_reward("The answer is (C)", "C") == 1.0
    assert rc.multiple_choice_reward("The answer is (C)", "(c)") == 1.0
    assert rc.multiple_choice_reward("The answer is (B)", "C") == 0.0


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("so the result is \\boxed{\\frac{3}{4}}", "0.75", 1.0),
        ("\\boxed{\\dfrac{6}{8}}", "3/4", 1.0),
        ("We get 1,234 apples in total.", "1234", 1.0),
        ("\\boxed{1,234,567}", "1234567", 1.0),
        ("\\boxed{12 \\text{ cm}}", "12", 1.0),
        ("The answer is 12 cm", "12", 1.0),
        ("\\boxed{x = 7}", "7", 1.0),
        ("Answer: 50\\%", "50", 1.0),
        ("\\boxed{\\$3.50}", "3.5", 1.0),
        ("The answer is $-2.5$.", "-5/2", 1.0),
        ("\\boxed{\\frac{1}{3}}", "0.333", 0.0),
        ("\\boxed{41}", "42", 0.0),
        ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", 1.0),
        ("\\boxed{\\sqrt{2}}", "\\sqrt{3}", 0.0),
        ("no number here", "5", 0.0),
        ("first 3 then \\boxed{5} then 9", "5", 1.0),
    ],
)
def test_math_reward(response: str, truth: str, expected: float) -> None:
    assert rc.math_reward(response, truth) == expected


def test_extract_boxed_balances_braces() -> None:
    assert rc.extract_boxed("a \\boxed{\\frac{1}{2}} b \\boxed{{x}+1}") == "{x}+1"
    assert rc.extract_boxed("\\boxed{unclosed") is None
    assert rc.extract_boxed("nothing") is None


def test_normalize_number() -> None:
    from fractions import Fraction

    assert rc.normalize_number("\\frac{3}{4}") == Fraction(3, 4)
    assert rc.normalize_number("-1,000.5") == Fraction(-2001, 2)
    assert rc.normalize_number("7 kg") == 7
    assert rc.normalize_number("x + 1") is None
    assert rc.normalize_number("1/0") is None


def test_format_reward() -> None:
    assert rc.format_reward("<think>\nstep\n</think>\n<answer>4</answer>") == 1.0
    assert rc.format_reward("<answer>4</answer>") == 0.0
    assert rc.format_reward("<think>x</think><answer>4</answer> trailing") == 0.0
    assert rc.format_reward("ANSWER: 4", pattern=r"ANSWER: \d+") == 1.0


def test_registry_is_an_explicit_dict() -> None:
    assert set(rc.REWARD_REGISTRY) == {
        "exact_match",
        "multiple_choice",
        "math",
        "format",
        "math_verify",
        "regex",
        "length_penalty",
        "weighted",
    }
    assert rc.resolve_reward_fn("math") is rc.math_reward


def user_reward(response: str, ground_truth: object, *, bonus: float = 0.0) -> float:
    return float(len(response)) + bonus


def test_user_reward_by_dotted_path() -> None:
    for name in (f"{__name__}:user_reward", f"{__name__}.user_reward"):
        assert rc.resolve_reward_fn(name) is user_reward


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no_such_reward", "not one of"),
        ("no_such_module_xyz.fn", "cannot import module"),
        ("relax_core:no_such_fn", "no callable"),
    ],
)
def test_unresolvable_reward_names(name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rc.resolve_reward_fn(name)
