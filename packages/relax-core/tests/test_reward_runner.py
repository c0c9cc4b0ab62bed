"""More built-in rewards, user rewards from files, the routing runner (timeouts, fallbacks, counts)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

import relax_core as rc


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("so \\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{\\sqrt{2}}{2}", 1.0),  # symbolic: needs math-verify
        ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
        ("\\boxed{x^2+1}", "x^2+2x+1", 0.0),
        ("We get 1,234 apples in total.", "1234", 1.0),  # the exact numeric path
        ("\\boxed{\\frac{1}{3}}", "0.333", 0.0),
        ("\\boxed{41}", "42", 0.0),
        ("no answer", "\\pi", 0.0),
    ],
)
def test_math_verify_reward(response: str, truth: str, expected: float) -> None:
    assert rc.math_verify_reward(response, truth) == expected
    assert rc.REWARD_REGISTRY["math_verify"] is rc.math_verify_reward


def test_regex_reward() -> None:
    assert rc.regex_reward("The answer: 42", pattern=r"answer: \d+") == 1.0
    assert rc.regex_reward("The answer: 42", pattern=r"answer: \d+", mode="fullmatch") == 0.0
    assert rc.regex_reward("ANSWER: 4", pattern=r"answer", flags="i") == 1.0
    assert rc.regex_reward("ANSWER: 4", pattern=r"answer", flags="") == 0.0
    assert rc.regex_reward("id-77", r"id-\d{2}") == 1.0  # the ground truth as the pattern
    with pytest.raises(ValueError, match="unknown flag 'x'"):
        rc.regex_reward("a", pattern="a", flags="x")


def test_length_penalty_reward() -> None:
    # target 10, max 30: 0 up to 10 chars, then -1/20 per char, -1 from 30 on.
    assert rc.length_penalty_reward("a" * 10, target=10, max_length=30) == 0.0
    assert rc.length_penalty_reward("a" * 15, target=10, max_length=30) == -0.25
    assert rc.length_penalty_reward("a" * 40, target=10, max_length=30) == -1.0
    assert rc.length_penalty_reward("one two three four", target=2, max_length=6, unit="words") == -0.5
    with pytest.raises(ValueError, match="must exceed target"):
        rc.length_penalty_reward("a", target=5, max_length=5)


def test_weighted_reward() -> None:
    terms = [
        {"fn": "math", "weight": 1.0},
        {"fn": "regex", "weight": 0.5, "kwargs": {"pattern": r"\\boxed"}},
        {"fn": "length_penalty", "weight": 0.2, "kwargs": {"target": 10, "max_length": 30}},
    ]
    response = "x is \\boxed{7}"  # 14 chars: penalty -(4/20) = -0.2
    assert rc.weighted_reward(response, "7", terms=terms) == pytest.approx(1.0 + 0.5 - 0.2 * 0.2)
    assert rc.weighted_reward(response, "8", terms=terms) == pytest.approx(0.5 - 0.04)
    with pytest.raises(ValueError, match="needs 'fn'"):
        rc.weighted_reward("a", "a", terms=[{"weight": 1.0}])


USER_FILE = '''
import asyncio
import threading

RELEASE = threading.Event()

def with_metadata(response, ground_truth, metadata, *, bonus=0.0):
    return {"score": float(response == ground_truth) + bonus, "source": metadata["data_source"], "n": metadata["n"]}

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's custom reward signature."""
    return float(solution_str.strip() == ground_truth) + (0.5 if data_source == "bonus" else 0.0)

def batched(responses, ground_truths, metadatas):
    return [len(r) / len(g) for r, g in zip(responses, ground_truths)]  # ZeroDivisionError on an empty truth

def raising(response, ground_truth):
    if response == "boom":
        raise KeyError("missing field")
    return 1.0

def hanging(response, ground_truth):
    if response == "hang":
        RELEASE.wait()  # the test sets it at the end, so no thread outlives the test
    return 1.0

async def async_hanging(response, ground_truth, metadata):
    if response == "hang":
        await asyncio.sleep(3600)
    return 0.75

def index_of(response, ground_truth):
    if response == "r4":
        raise SystemExit("a reward must not end the run")
    return float(response[1:])

def bad_value(response, ground_truth):
    return {"sc0re": 1} if response == "dict" else ("1.0" if response == "str" else float("nan"))
'''


@pytest.fixture
def user_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_FILE)
    return path


def runner_for(spec: str, **cfg: Any) -> rc.RewardRunner:
    kind = cfg.pop("kind", "auto")
    return rc.build_reward_runner(rc.RewardRunnerConfig(default=rc.RewardSpec(fn=spec, kind=kind), **cfg))


def test_user_file_reward_with_metadata_and_details(user_file: Path) -> None:
    cfg = rc.RewardRunnerConfig(
        default=rc.RewardSpec(fn=f"{user_file.name}:with_metadata", kwargs={"bonus": 0.25}),
        base_dir=str(user_file.parent),
    )
    with rc.build_reward_runner(cfg) as runner:
        out = runner.score([rc.RewardRequest("a", "a", "geo", {"n": 1}), rc.RewardRequest("b", "a", "geo", {"n": 2})])
    assert [o.score for o in out] == [1.25, 0.25]
    assert out[0].details == {"source": "geo", "n": 1} and out[1].details["n"] == 2
    assert runner.stats.scored == 2 and runner.stats.errors == 0


def test_verl_signature_and_routing_by_data_source(user_file: Path) -> None:
    cfg = rc.RewardRunnerConfig(
        default=rc.RewardSpec(fn="exact_match"),
        routes={
            "gsm8k": rc.RewardSpec(fn="relax_core:math_reward"),  # module:function
            "bonus": rc.RewardSpec(fn=f"{user_file}:compute_score"),
        },
    )
    requests = [
        rc.RewardRequest("\\boxed{1,000}", "1000", "gsm8k"),
        rc.RewardRequest(" yes ", "yes", "bonus"),
        rc.RewardRequest("Yes", "yes", "other"),  # unrouted: exact match, case-insensitive
        rc.RewardRequest("1000", "1,000", "other"),
    ]
    with rc.build_reward_runner(cfg) as runner:
        out = runner.score(requests)
    assert [o.score for o in out] == [1.0, 1.5, 1.0, 0.0]
    assert [o.route for o in out] == ["gsm8k", "bonus", "default", "default"]
    assert runner.stats.by_route["default"]["scored"] == 2


def test_batched_user_reward_isolates_a_failing_sample(user_file: Path) -> None:
    with runner_for(f"{user_file}:batched", kind="batched", fallback_score=-1.0) as runner:
        out = runner.score([rc.RewardRequest("ab", "abcd"), rc.RewardRequest("x", ""), rc.RewardRequest("abc", "abc")])
    assert [o.score for o in out] == [0.5, -1.0, 1.0]
    assert out[1].error is not None and out[1].error.startswith("ZeroDivisionError")
    assert runner.stats.errors == 1


def test_raising_and_unusable_rewards_get_the_fallback_and_are_counted(user_file: Path) -> None:
    with runner_for(f"{user_file}:raising", fallback_score=-0.5) as runner:
        out = runner.score([rc.RewardRequest("ok"), rc.RewardRequest("boom"), rc.RewardRequest("ok")])
    assert [o.score for o in out] == [1.0, -0.5, 1.0]
    assert out[1].error == "KeyError: 'missing field'" and runner.stats.errors == 1
    assert runner.stats.last_error == "KeyError: 'missing field'"
    with runner_for(f"{user_file}:bad_value") as runner:
        out = runner.score([rc.RewardRequest("dict"), rc.RewardRequest("str"), rc.RewardRequest("nan")])
    assert [o.score for o in out] == [0.0, 0.0, 0.0] and runner.stats.errors == 3
    errors = [o.error or "" for o in out]
    assert "without 'score'" in errors[0] and "expected a float" in errors[1]
    assert "non-finite" in errors[2]


def test_sync_rewards_split_over_workers_keep_the_request_order(user_file: Path) -> None:
    with runner_for(f"{user_file}:index_of", max_concurrency=3) as runner:
        out = runner.score([rc.RewardRequest(f"r{i}") for i in range(10)])
    assert [o.score for o in out] == [0.0, 1.0, 2.0, 3.0, 0.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    assert out[4].error == "SystemExit: a reward must not end the run" and runner.stats.errors == 1


def test_hanging_rewards_time_out_and_the_run_goes_on(user_file: Path) -> None:
    import sys

    with runner_for(f"{user_file}:hanging", timeout_s=0.5, fallback_score=-1.0, max_concurrency=1) as runner:
        try:
            requests = [rc.RewardRequest(r) for r in ("fine", "hang", "fine", "fine")]
            out = runner.score(requests)
            # The one worker is stuck in the second call; its replacement scores the rest.
            assert [o.score for o in out] == [1.0, -1.0, 1.0, 1.0]
            assert out[1].error == "TimeoutError: no reward within 0.5 s"
            assert runner.stats.timeouts == 1 and runner.stats.errors == 1 and runner.stats.hung_threads == 1
        finally:
            next(m for m in sys.modules.values() if getattr(m, "__file__", None) == str(user_file)).RELEASE.set()
    with runner_for(f"{user_file}:async_hanging", timeout_s=0.5) as runner:
        out = runner.score([rc.RewardRequest("hang"), rc.RewardRequest("fine")])
    assert [o.score for o in out] == [0.0, 0.75] and runner.stats.timeouts == 1


def test_async_and_sync_rewards_from_async_code(user_file: Path) -> None:
    runner = runner_for(f"{user_file}:async_hanging")

    async def main() -> list[rc.RewardOutcome]:
        return await runner.ascore([rc.RewardRequest("a"), rc.RewardRequest("b")])

    assert [o.score for o in asyncio.run(main())] == [0.75, 0.75]
    runner.close()


def test_loading_errors_name_what_is_wrong(tmp_path: Path, user_file: Path) -> None:
    with pytest.raises(ValueError, match=r"file '.*nowhere\.py' does not exist"):
        rc.load_reward_fn(f"{tmp_path}/nowhere.py:fn")
    with pytest.raises(ValueError, match="has no callable 'absent'"):
        rc.load_reward_fn(f"{user_file}:absent")
    (tmp_path / "broken.py").write_text("import not_a_module_xyz\n")
    with pytest.raises(ValueError, match=r"importing .* failed: ModuleNotFoundError"):
        rc.load_reward_fn(f"{tmp_path}/broken.py:fn")
    assert rc.load_reward_fn(f"{user_file}:raising") is rc.load_reward_fn(f"{user_file}:raising")  # loaded once
    with pytest.raises(ValueError, match=r"route 'geo'.*not one of"):
        rc.build_reward_runner(rc.RewardRunnerConfig(routes={"geo": rc.RewardSpec(fn="no_such")}))
    with pytest.raises(ValueError, match="is a coroutine function"):
        runner_for(f"{user_file}:async_hanging", kind="scalar")
    with pytest.raises(ValueError, match="go together"):
        rc.RewardSpec(fn="remote")


def test_call_style_reads_the_signature() -> None:
    def two(response: str, ground_truth: Any) -> float:
        return 0.0

    def three(response: str, ground_truth: Any, metadata: Mapping[str, Any]) -> float:
        return 0.0

    def verl_batched(
        data_sources: Sequence[str], solution_strs: Sequence[str], ground_truths: Any, extra_infos: Any
    ) -> list[float]:
        return []

    async def coro(response: str, ground_truth: Any) -> float:
        return 0.0

    assert rc.call_style(two) == rc.CallStyle(batched=False, is_async=False, metadata=False, verl=False)
    assert rc.call_style(three).metadata
    assert rc.call_style(verl_batched) == rc.CallStyle(batched=True, is_async=False, metadata=False, verl=True)
    assert rc.call_style(coro).is_async and rc.call_style(coro, "async_batched").batched
