"""The controller's checkpoint cadence: by updates, and by time since the last checkpoint (on a monotonic clock)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from relax_services.config import load_run_config
from relax_services.control.controller import Controller


def _controller(tmp_path: Path, *overrides: str) -> Controller:
    cfg = load_run_config(None, ["trainer.checkpoint_every=50", *overrides])
    return Controller(cfg, tmp_path)


def test_a_checkpoint_is_due_by_updates_or_by_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    now = {"t": 1000.0}
    monkeypatch.setattr(time, "monotonic", lambda: now["t"])
    ctl = _controller(tmp_path, "trainer.checkpoint_every_s=120")
    ctl._checkpoint_step, ctl._checkpoint_time = 10, 1000.0
    ctl.step = 11
    assert not ctl._checkpoint_due()  # one update, no time passed
    now["t"] = 1119.0
    assert not ctl._checkpoint_due()
    now["t"] = 1120.0
    assert ctl._checkpoint_due()  # 120 s with a new update: a failure now costs at most that much work
    ctl.step = 10
    assert not ctl._checkpoint_due()  # nothing new since the last checkpoint
    ctl.step = 60
    now["t"] = 1001.0
    assert ctl._checkpoint_due()  # checkpoint_every updates
    untimed = _controller(tmp_path / "b", "trainer.checkpoint_every_s=null")
    untimed._checkpoint_step, untimed._checkpoint_time, untimed.step = 0, 0.0, 5
    now["t"] = 1e9
    assert not untimed._checkpoint_due()
    ctl.metrics.close()
    untimed.metrics.close()


def test_the_run_clock_counts_the_time_a_resumed_run_already_spent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = {"t": 50.0}
    monkeypatch.setattr(time, "monotonic", lambda: now["t"])
    ctl = Controller(load_run_config(), tmp_path, started_at=40.0)  # the command started 10 s before
    assert ctl.clock() == 10.0
    ctl.metrics.start -= 300.0  # what a resume does with the checkpoint's elapsed_s
    now["t"] = 60.0
    assert ctl.clock() == 320.0
    ctl.metrics.close()
