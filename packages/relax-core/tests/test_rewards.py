"""Reward functions, the registry and failure isolation."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

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


async def async_user_reward(response: str, ground_truth: object) -> float:
    await asyncio.sleep(0.2 if response == "slow" else 0.0)
    if response == "boom":
        raise RuntimeError("sandbox crashed")
    return 1.0


def batched_user_reward(responses: Sequence[str], ground_truths: Sequence[object]) -> list[float]:
    return [1.0 / len(r) for r in responses]  # raises ZeroDivisionError on an empty response


def test_user_reward_by_dotted_path() -> None:
    module = __name__
    for name in (f"{module}:user_reward", f"{module}.user_reward"):
        scorer = rc.build_reward(rc.RewardConfig(name=name, kwargs={"bonus": 0.5}))
        assert scorer.kind == "scalar"
        assert scorer.score(["abc"], [None]) == [rc.RewardResult(3.5)]


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
        rc.build_reward(rc.RewardConfig(name=name))


def test_declared_kind_must_match_the_function() -> None:
    with pytest.raises(ValueError, match="not a coroutine"):
        rc.build_reward(rc.RewardConfig(name="math", kind="async"))
    with pytest.raises(ValueError, match="is a coroutine"):
        rc.build_reward(rc.RewardConfig(name=f"{__name__}:async_user_reward", kind="scalar"))


def test_a_raising_scalar_reward_fails_only_its_sample() -> None:
    def flaky(response: str, truth: object) -> float:
        if response == "bad":
            raise KeyError("missing field")
        if response == "nan":
            return float("nan")
        if response == "str":
            return "1.0"  # type: ignore[return-value]
        return 1.0

    scorer = rc.RewardScorer(flaky, "scalar", failure_reward=-1.0)
    results = scorer.score(["ok", "bad", "nan", "str", "ok"], [None] * 5)
    assert [r.reward for r in results] == [1.0, -1.0, -1.0, -1.0, 1.0]
    assert [r.ok for r in results] == [True, False, False, False, True]
    assert results[1].error == "KeyError: 'missing field'"
    assert results[2].error is not None and "non-finite" in results[2].error
    assert results[3].error is not None and "expected a float" in results[3].error


def test_a_raising_batched_reward_is_isolated_per_sample() -> None:
    scorer = rc.build_reward(rc.RewardConfig(name=f"{__name__}:batched_user_reward", kind="batched"))
    results = scorer.score(["ab", "", "abcd"], [None] * 3)
    assert [r.reward for r in results] == [0.5, 0.0, 0.25]
    assert results[1].error is not None and results[1].error.startswith("ZeroDivisionError")


def test_batched_reward_with_wrong_length_fails_its_samples() -> None:
    scorer = rc.RewardScorer(lambda rs, gs: [1.0], "batched")
    results = scorer.score(["a", "b"], [None, None])
    assert [r.ok for r in results] == [True, True]  # rescored one by one, each call returns one value
    broken = rc.RewardScorer(lambda rs, gs: [], "batched")
    assert all(r.error is not None and "0 values" in r.error for r in broken.score(["a"], [None]))


def test_async_reward_failures_and_timeouts() -> None:
    cfg = rc.RewardConfig(name=f"{__name__}:async_user_reward", timeout_s=0.05)
    scorer = rc.build_reward(cfg)
    assert scorer.kind == "async"
    results = scorer.score(["fine", "boom", "slow"], [None] * 3)
    assert results[0] == rc.RewardResult(1.0)
    assert results[1].error == "RuntimeError: sandbox crashed"
    assert results[2].error is not None and results[2].error.startswith("TimeoutError")


def test_ascore_from_async_code() -> None:
    scalar = rc.build_reward(rc.RewardConfig(name="exact_match"))
    async_scorer = rc.build_reward(rc.RewardConfig(name=f"{__name__}:async_user_reward"))

    async def main() -> tuple[list[rc.RewardResult], list[rc.RewardResult]]:
        return await scalar.ascore(["a"], ["a"]), await async_scorer.ascore(["x", "y"], [None, None])

    first, second = asyncio.run(main())
    assert first == [rc.RewardResult(1.0)] and second == [rc.RewardResult(1.0), rc.RewardResult(1.0)]


def test_mismatched_lengths_are_a_caller_error() -> None:
    with pytest.raises(ValueError, match="2 responses but 1 ground truths"):
        rc.build_reward(rc.RewardConfig()).score(["a", "b"], ["a"])
