"""The autoscaler's decisions on synthetic wait series, each decision derived by hand from the stated rule:
over a full window, Trainer wait share Σwait / Σ(wait + train) above ``up_wait_frac`` adds a replica; else the
replicas' blocked share Σblocked / Σ(blocked + busy) above ``down_block_frac`` removes one; bounded by min/max, no
change within ``cooldown_s`` of the last, the window emptied by each change."""

from __future__ import annotations

import pytest

from relax_core.config.base import ConfigError
from relax_services.config import load_run_config
from relax_services.config.services import AutoscaleConfig
from relax_services.control.autoscale import Autoscaler, UpdateWaits

CFG = AutoscaleConfig(enabled=True, min=1, max=3, window=3, up_wait_frac=0.4, down_block_frac=0.5, cooldown_s=10.0)


def _feed(scaler: Autoscaler, *waits: tuple[float, float, float, float]) -> None:
    for wait, train, busy, blocked in waits:
        scaler.observe(UpdateWaits(wait, train, busy, blocked))


def test_a_starved_trainer_adds_replicas_one_window_and_one_cooldown_at_a_time() -> None:
    scaler = Autoscaler(CFG, start_s=0.0)
    _feed(scaler, (1.0, 1.0, 2.0, 0.0), (1.0, 1.0, 2.0, 0.0))
    assert scaler.decide(20.0, 1) is None  # 2 of 3 updates: the window is not full
    _feed(scaler, (1.0, 1.0, 2.0, 0.0))
    assert scaler.shares() == (0.5, 0.0)  # 3 / 6 waiting, 0 / 6 blocked
    assert scaler.decide(5.0, 1) is None  # 5 s after the start: within the 10 s cool-down
    assert scaler.decide(12.0, 1) == 2  # 0.5 > 0.4
    scaler.changed(12.0)
    assert scaler.shares() == (0.0, 0.0)  # the window starts empty after a change
    _feed(scaler, (0.5, 1.0, 2.0, 0.0), (0.5, 1.0, 2.0, 0.0), (0.5, 1.0, 2.0, 0.0))
    assert scaler.decide(30.0, 2) is None  # 1.5 / 4.5 = 0.333 <= 0.4: enough replicas
    _feed(scaler, (2.0, 1.0, 2.0, 0.0))  # the window slides: 0.5 + 0.5 + 2 = 3 waiting of 3 + 3
    assert scaler.decide(30.0, 2) == 3
    scaler.changed(30.0)
    _feed(scaler, (5.0, 1.0, 0.0, 0.0), (5.0, 1.0, 0.0, 0.0), (5.0, 1.0, 0.0, 0.0))
    assert scaler.decide(100.0, 3) is None  # 15 / 18 waiting, but 3 is the max


def test_blocked_replicas_are_removed_down_to_min_and_the_threshold_is_strict() -> None:
    scaler = Autoscaler(CFG)
    _feed(scaler, (0.0, 1.0, 1.0, 3.0), (0.0, 1.0, 1.0, 3.0), (0.0, 1.0, 1.0, 1.0))
    assert scaler.shares() == (0.0, 7.0 / 10.0)
    assert scaler.decide(11.0, 3) == 2  # 0.7 > 0.5
    scaler.changed(11.0)
    _feed(scaler, (0.0, 1.0, 2.0, 2.0), (0.0, 1.0, 2.0, 2.0), (0.0, 1.0, 2.0, 2.0))
    assert scaler.decide(25.0, 2) is None  # 6 / 12 = 0.5 exactly: not above
    _feed(scaler, (0.0, 1.0, 0.0, 4.0))  # now 2 + 2 + 4 = 8 blocked of 12
    assert scaler.decide(25.0, 2) == 1
    scaler.changed(25.0)
    _feed(scaler, (0.0, 1.0, 0.0, 4.0), (0.0, 1.0, 0.0, 4.0), (0.0, 1.0, 0.0, 4.0))
    assert scaler.decide(50.0, 1) is None  # all blocked, but 1 is the min
    # A trainer that waits wins over blocked replicas (the starved side decides): 2 / 4 = 0.5 > 0.4.
    _feed(scaler, (2.0, 1.0, 0.0, 4.0), (0.0, 1.0, 0.0, 4.0), (0.0, 0.0, 0.0, 4.0))
    assert scaler.decide(50.0, 1) == 2


def test_a_count_set_out_of_bounds_comes_back_one_at_a_time_after_the_cooldown() -> None:
    scaler = Autoscaler(CFG)
    assert scaler.decide(5.0, 6) is None  # cool-down first
    assert scaler.decide(10.0, 6) == 5  # above max, whatever the (empty) window says
    assert Autoscaler(AutoscaleConfig(min=2, max=3, cooldown_s=0.0)).decide(0.0, 1) == 2
    with pytest.raises(ValueError, match="replicas must be >= 1, got 0"):
        scaler.decide(10.0, 0)
    with pytest.raises(ValueError, match=r"UpdateWaits.blocked_s must be >= 0, got -1"):
        UpdateWaits(0.0, 1.0, 0.0, -1.0)


def test_autoscale_config_is_bounded_and_named() -> None:
    cfg = load_run_config(None, ["rollout.autoscale.enabled=true", "rollout.autoscale.max=2"])
    assert cfg.rollout.autoscale.enabled and (cfg.rollout.autoscale.min, cfg.rollout.autoscale.max) == (1, 2)
    with pytest.raises(ConfigError, match=r"rollout.autoscale.min \(3\) is above rollout.autoscale.max \(2\)"):
        load_run_config(None, ["rollout.autoscale.min=3", "rollout.autoscale.max=2"])
    with pytest.raises(ConfigError, match=r"rollout\.autoscale\.up_wait_frac"):
        load_run_config(None, ["rollout.autoscale.up_wait_frac=1.5"])
    with pytest.raises(ConfigError, match=r"rollout.autoscale.enabled=true with run.mode=colocated"):
        load_run_config(None, ["rollout.autoscale.enabled=true", "run.mode=colocated"])
