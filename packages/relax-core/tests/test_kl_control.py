"""The KL coefficient controller: fixed, or adaptive toward its target (Ziegler et al. 2019), by hand."""

from __future__ import annotations

import pytest

import relax_core as rc


def _adaptive(coef: float = 0.2, target: float = 0.1, horizon: int = 100) -> rc.KLController:
    cfg = rc.load_config(
        rc.AlgorithmConfig,
        {"kl_coef": coef, "kl_ctrl": {"type": "adaptive", "target_kl": target, "horizon": horizon}},
    )
    return rc.KLController.from_config(cfg)


def test_adaptive_hand_values() -> None:
    ctrl = _adaptive()
    # KL 0.11 over 10 samples: error 0.1, β = 0.2 · (1 + 0.1 · 10/100) = 0.202.
    assert ctrl.update(0.11, 10) == pytest.approx(0.202, rel=1e-12)
    # KL 1.0: error clipped to 0.2; β = 0.202 · 1.02.
    assert ctrl.update(1.0, 10) == pytest.approx(0.202 * 1.02, rel=1e-12)
    # KL 0: error clipped to −0.2; β shrinks by 1 − 0.2 · 50/100 = 0.9.
    assert ctrl.update(0.0, 50) == pytest.approx(0.202 * 1.02 * 0.9, rel=1e-12)


def test_adaptive_moves_toward_the_target_and_fixed_does_not_move() -> None:
    above, below = _adaptive(), _adaptive()
    for _ in range(5):
        above.update(0.3, 8)  # KL above target: β grows, the penalty pulls KL down
        below.update(0.01, 8)  # below: β shrinks
    assert above.value > 0.2 > below.value
    fixed = rc.KLController.from_config(rc.AlgorithmConfig(kl_coef=0.2))
    assert fixed.update(5.0, 100) == 0.2


def test_state_round_trip_and_config_checks() -> None:
    ctrl = _adaptive()
    ctrl.update(0.5, 40)
    fresh = _adaptive()
    fresh.load_state_dict(ctrl.state_dict())
    assert fresh.value == ctrl.value != 0.2
    with pytest.raises(rc.ConfigError, match="kl_ctrl"):
        rc.load_config(rc.AlgorithmConfig, {"kl_ctrl": {"type": "adaptive"}})  # kl_coef 0: nothing to adapt
    with pytest.raises(rc.ConfigError, match=r"kl_ctrl\.horizon"):
        rc.load_config(rc.AlgorithmConfig, {"kl_coef": 0.1, "kl_ctrl": {"type": "adaptive", "horizon": 0}})
