"""The end-of-run summary: its headline speaks of the final weights' evaluation only, its statement about learning
from reward alone follows a stated rule, and its rates and durations read as numbers for people."""

from __future__ import annotations

from pathlib import Path

from relax_services.control.controller import RunResult
from relax_services.reporting.summary import format_summary, headline, learned_line


def _result(final_version: int | None) -> RunResult:
    return RunResult(
        run_dir=Path("run"),
        steps=543,
        wall_s=226.0,
        stop_reason="target reward reached",
        final_eval={"text": 0.875, "image": 1.0},
        chance={"text": 0.1, "image": 0.5},
        ledger={"generated": 10, "lost": 0},
        samples=1000,
        first_step_reaching={"image": 107.0},
        final_version=final_version,
        target_reward=0.9,
        target_version=540,
    )


def test_the_headline_speaks_of_the_final_weights_only() -> None:
    """The stop came from version 540's evaluation; the final weights (543) score text at 0.875 < 0.9: the headline
    says so with the table's number, and names version 540 without a number of its own."""
    lines = format_summary(_result(543)).splitlines()
    assert (
        lines[0]
        == "relax train finished: target reward reached after 543 updates in 3m46s (1000 samples, 4.4 samples/s)"
    )
    assert lines[1] == "final weights (version 543): held-out reward below the target 0.9 on text 0.875"
    assert lines[2] == "(the run stopped when the evaluation of version 540 met the target)"
    assert lines[4].endswith("(reward: final weights, version 543)")
    assert lines[5].split() == ["image", "1.000", "0.500", "107s"]
    assert lines[6].split() == ["text", "0.875", "0.100", "-"]
    numbers = {w for line in lines[:3] for w in line.replace(",", " ").split() if w[0].isdigit() and "." in w}
    assert numbers <= {"0.9", "0.875", "4.4"}  # no reward but the final weights' (and the target, and the rate)

    met = _result(543)
    met.final_eval = {"text": 0.9, "image": 1.0}  # the boundary: >= target is met
    assert headline(met)[1:] == ["final weights (version 543): held-out reward >= 0.9 on every task"]
    unevaluated = _result(None)
    assert headline(unevaluated)[1].startswith("the last evaluation: held-out reward below the target 0.9")
    assert "version" not in format_summary(unevaluated).splitlines()[4]  # no final evaluation to name


def test_rates_are_never_rounded_to_zero() -> None:
    slow = _result(543)
    slow.samples, slow.wall_s = 64, 160.0  # 0.4 samples/s
    assert headline(slow)[0].endswith("in 2m40s (64 samples, 0.4 samples/s)")
    slow.samples = 1  # 1/160 = 0.00625 samples/s
    assert headline(slow)[0].endswith("(1 samples, < 0.01 samples/s)")


def test_learning_from_reward_alone_is_claimed_only_when_every_task_rose_above_its_start_and_chance() -> None:
    result = _result(543)
    result.first_eval_version, result.first_eval = 0, {"text": 0.42, "image": 0.5}
    result.final_eval = {"text": 0.84, "image": 0.75}
    assert learned_line(result) == (
        "no supervised warm-up: held-out reward rose above the first evaluation (version 0) and above chance on "
        "every task"
    )
    result.final_eval = {"text": 0.34, "image": 0.75}  # the SmolLM2 case: 0.42 -> 0.34
    line = learned_line(result)
    assert line.startswith("no supervised warm-up; held-out reward did not rise") and line.endswith(
        "text 0.420 -> 0.340"
    )
    result.final_eval = {"text": 0.84, "image": 0.5}  # image flat at its chance level 0.5: not a rise
    assert learned_line(result).endswith("on: image 0.500 -> 0.500")
    result.chance = {"text": float("nan"), "image": 0.25}  # chance unknown: judged against the first evaluation only
    result.final_eval = {"text": 0.5, "image": 0.75}
    assert "rose above" in learned_line(result)
    result.first_eval_version = 543  # no evaluation before the final one: nothing is claimed
    assert learned_line(result) == "no supervised warm-up; no evaluation before the final one to compare it with"
    result.warmup_steps = 30
    assert learned_line(result).startswith("opened with 30 supervised format warm-up steps")


def test_summary_says_why_a_chance_level_is_unknown() -> None:
    result = _result(543)
    result.chance = {"text": float("nan"), "image": 0.5}
    result.data = {
        "train_files": ["t.jsonl"],
        "eval_files": ["e.jsonl"],
        "bad_rows": 0,
        "bad_rows_by_file": {},
        "recent_bad_rows": [],
        "heldout_by_source": {"text": 4, "image": 4},
        "chance_unknown": {"text": "rows list no choices (extra_info.options) for the 'math' reward"},
    }
    lines = format_summary(result).splitlines()
    assert lines[6].split() == ["text", "0.875", "-", "-"]
    assert "chance of text unknown ('-'): rows list no choices (extra_info.options) for the 'math' reward" in lines
