"""The end-of-run summary says which weights its reward table scores."""

from __future__ import annotations

from pathlib import Path

from relax_services.control.controller import RunResult
from relax_services.reporting.summary import format_summary


def _result(final_version: int | None) -> RunResult:
    return RunResult(
        run_dir=Path("run"),
        steps=543,
        wall_s=226.0,
        stop_reason="held-out reward >= 0.9 on every task (weights of version 540)",
        final_eval={"text": 0.875, "image": 1.0},
        chance={"text": 0.1, "image": 0.5},
        ledger={"generated": 10, "lost": 0},
        samples=1000,
        first_step_reaching={"image": 107.0},
        final_version=final_version,
    )


def test_summary_names_the_stop_evaluation_and_the_final_weights() -> None:
    lines = format_summary(_result(543)).splitlines()
    assert lines[0].startswith("relax train finished: held-out reward >= 0.9 on every task (weights of version 540)")
    assert lines[2].endswith("(reward: final weights, version 543)")
    assert lines[3].split() == ["image", "1.000", "0.500", "107s"]
    assert lines[4].split() == ["text", "0.875", "0.100", "-"]
    assert "version" not in format_summary(_result(None)).splitlines()[2]  # no evaluation to name


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
    assert lines[4].split() == ["text", "0.875", "-", "-"]
    assert "chance of text unknown ('-'): rows list no choices (extra_info.options) for the 'math' reward" in lines
