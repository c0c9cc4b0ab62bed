"""Live progress reads as numbers for people: rates not rounded to 0, an ETA only once an update's time is known."""

from __future__ import annotations

from relax_services.reporting._units import format_duration, format_eta, format_rate
from relax_services.reporting.progress import Progress, ProgressState


def _state(step: int, rate: float, eta: float | None) -> ProgressState:
    return {
        "wall": 30.0, "step": step, "total_steps": 1000, "reward": 0.25, "eval": {}, "chance": {},
        "max_staleness": 1, "depth_rows": 8, "samples_per_s": rate, "eta_s": eta, "restarts": 0,
    }  # fmt: skip


def test_rates_keep_their_digits() -> None:
    cases = {0.0: "0", 0.004: "< 0.01", 0.043: "0.043", 0.4: "0.4", 0.96: "0.96", 1.0: "1.0", 12.34: "12.3"}
    cases |= {100.0: "100", 1234.5: "1234"}
    assert {x: format_rate(x) for x in cases} == cases


def test_durations_and_the_eta_before_the_first_update() -> None:
    assert [format_duration(s) for s in (0, 59.9, 60, 425, 3599, 3600, 7380)] == [
        "0s", "59s", "1m00s", "7m05s", "59m59s", "1h00m", "2h03m",
    ]  # fmt: skip
    assert format_eta(0, 480.0) == "after the first update"  # the time limit is not an estimate
    assert format_eta(3, 425.0) == "7m05s"
    assert format_eta(3, None) == "?"
    line = Progress._line(_state(0, 0.4, None))
    assert line.endswith("0.4 samples/s  ETA after the first update"), line
