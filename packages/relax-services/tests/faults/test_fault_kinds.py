"""The fault kinds a run can inject and where: a ``break`` leaves a service's process unable to rebuild it (what
makes the health manager replace the process), and the Evaluator (``eval``) is a target in every mode."""

from __future__ import annotations

import os
from typing import ClassVar

import pytest

from relax_core import ConfigError
from relax_services.bench.chaos import chaos_targets, global_restarts_needed, random_faults
from relax_services.config import FaultSpec, load_run_config
from relax_services.control.colocated import check_colocated
from relax_services.services._base import ServiceBase


class _Idle(ServiceBase):
    """A service without a model whose unit of work is a short wait; counts its constructions."""

    model_stack: ClassVar[bool] = False
    built: ClassVar[int] = 0

    def __init__(self, name: str) -> None:
        super().__init__(name, None)
        type(self).built += 1

    def step(self) -> None:
        self._stop.wait(0.01)


def _raised(service: ServiceBase, kind: str) -> None:
    """Inject ``kind`` and wait until the work loop has ended on it."""
    service.inject(kind)
    assert service._thread is not None
    service._thread.join(120)
    assert not service._thread.is_alive() and "injected fault" in str(service.status()["error"])


def test_a_raise_is_rebuilt_in_its_process_and_a_break_is_not() -> None:
    _Idle.built = 0
    service = _Idle("reward")
    service.start()
    _raised(service, "raise")
    assert service.rebuild("reward") == os.getpid() and _Idle.built == 2  # the constructor ran again
    assert service.status()["error"] is None
    _raised(service, "break")
    with pytest.raises(RuntimeError, match="reward: injected fault 'break': this process cannot rebuild the service"):
        service.rebuild("reward")
    with pytest.raises(RuntimeError, match="cannot rebuild"):  # however often it is tried
        service.rebuild("reward")
    assert _Idle.built == 2
    fresh = _Idle("reward")  # what a new process builds: no damage carried over
    fresh.start()
    _raised(fresh, "raise")
    assert fresh.rebuild("reward") == os.getpid()
    fresh.stop()


def test_an_unknown_injected_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="inject kind must be 'raise', 'hang' or 'break', got 'explode'"):
        _Idle("reward").inject("explode")


def test_faults_can_target_the_evaluator() -> None:
    cfg = load_run_config(None, ["faults=[{service: eval, kind: raise, at_step: 2}, {service: eval, kind: break}]"])
    assert [(f.service, f.kind) for f in cfg.faults] == [("eval", "raise"), ("eval", "break")]
    with pytest.raises(ConfigError, match="'evaluator'"):
        load_run_config(None, ["faults=[{service: evaluator}]"])
    with pytest.raises(ValueError, match="can only be killed"):
        FaultSpec(service="weights", kind="break")


def test_colocated_takes_eval_raises_and_hangs_but_refuses_a_break() -> None:
    colocated = "run.mode=colocated"
    check_colocated(
        load_run_config(None, [colocated, "faults=[{service: eval, kind: raise}, {service: eval, kind: hang}]"])
    )
    broken = load_run_config(None, [colocated, "faults=[{service: eval, kind: hang}, {service: reward, kind: break}]"])
    with pytest.raises(ValueError, match=r"faults\[1\].kind=break needs a process to replace \(run.mode=distributed\)"):
        check_colocated(broken)


def test_chaos_hits_the_evaluator_when_asked() -> None:
    cfg = load_run_config()
    assert chaos_targets(cfg, evaluator=True) == ("rollout", "reward", "reference", "eval", "trainer")
    roles = chaos_targets(cfg, evaluator=True)
    for seed in range(10):  # 5 faults on 5 roles: each role once, each kind at least once
        faults = random_faults(5, seed=seed, total_steps=40, services=roles)
        assert sorted(f.service for f in faults) == sorted(roles)
        assert {f.kind for f in faults} == {"kill", "raise", "hang"}


def test_a_break_beside_the_trainer_is_a_global_restart_and_elsewhere_is_not() -> None:
    faults = [FaultSpec(service="eval", kind="break"), FaultSpec(service="reward", kind="break")]
    assert global_restarts_needed(faults) == 0  # the default hosts: each replaced in place with its host
    assert global_restarts_needed(faults, [["trainer", "eval"], ["rollout", "reward"]]) == 1


def test_relax_chaos_eval_faults_puts_the_evaluator_in_the_plan() -> None:
    from relax_services.bench.chaos import chaos_config
    from relax_services.cli import build_parser

    assert build_parser().parse_args(["chaos", "--eval-faults"]).eval_faults is True
    assert build_parser().parse_args(["chaos"]).eval_faults is False
    with_eval = chaos_config(None, [], 5, seed=0, evaluator=True)
    assert sorted(f.service for f in with_eval.faults) == ["eval", "reference", "reward", "rollout", "trainer"]
    assert "eval" not in {f.service for f in chaos_config(None, [], 5, seed=0).faults}
