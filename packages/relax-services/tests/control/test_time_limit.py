"""``trainer.max_minutes`` counts from the command (the run's one clock), start-up included: the run stops once
that clock reaches the limit, whether or not an update has happened."""

from __future__ import annotations

import time
from pathlib import Path

from relax_services.config import load_run_config
from relax_services.control.controller import Controller


def _controller(tmp_path: Path, started_s_ago: float, *overrides: str) -> Controller:
    cfg = load_run_config(None, ["trainer.max_minutes=2", *overrides])
    controller = Controller(cfg, tmp_path, started_at=time.monotonic() - started_s_ago)
    controller.metrics.close()  # only its clock is used here
    return controller


def test_the_time_limit_counts_from_the_command_start_up_included(tmp_path: Path) -> None:
    """The command began 120 s ago (all of it start-up: no update yet): the 2-minute limit is spent; 1 s earlier,
    about 1 s is left. Measured against the run's clock, which only moves forward between the two reads."""
    spent = _controller(tmp_path, 120.0)
    assert spent.step == 0 and spent.time_left_s() <= 0  # type: ignore[operator]
    before = _controller(tmp_path, 119.0)
    left = before.time_left_s()
    assert left is not None and 0 < left <= 1.0
    assert _controller(tmp_path, 1e6, "trainer.max_minutes=null").time_left_s() is None


def test_a_resumed_run_counts_its_earlier_time(tmp_path: Path) -> None:
    controller = _controller(tmp_path, 10.0)
    controller.metrics.start -= 115.0  # what Controller.run does with a checkpoint's elapsed_s (115 s earlier)
    assert controller.time_left_s() <= 0  # type: ignore[operator]
