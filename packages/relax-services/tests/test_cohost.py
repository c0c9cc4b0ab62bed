"""Roles sharing one process (``run.hosts``): the config's rules, the host's call routing, and the health manager's
host-aware restarts (a raise rebuilds one role in its host; a dead or hung host restarts every role it held)."""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace
from typing import Any

import pytest

from relax_core import ConfigError
from relax_services._cohost import HostedHandle, ServiceGroupHost, SharedHost, group_class
from relax_services.config import HealthConfig, load_run_config
from relax_services.health import GlobalRestartNeeded, HealthManager
from relax_services.pipeline import ServiceSpec, shared_hosts


def test_the_default_run_hosts_reference_eval_and_reward_with_the_rollout() -> None:
    cfg = load_run_config(None, [])
    assert cfg.run.hosts == [["rollout", "reference", "eval", "reward"]]
    assert load_run_config(None, ["run.hosts=[]"]).run.hosts == []


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("run.hosts=[[trainer]]", "run.hosts[0]=['trainer']: a host shares one process between two roles or more"),
        ("run.hosts=[[trainer, critc]]", "run.hosts[0]: unknown role 'critc'"),
        ("run.hosts=[[trainer, eval], [reward, eval]]", "run.hosts[1]: role 'eval' is already in run.hosts[0]"),
    ],
)
def test_bad_hosts_are_rejected_naming_the_host(override: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_run_config(None, [override])
    assert words in str(info.value)


def test_roles_of_one_host_cannot_be_placed_apart() -> None:
    with pytest.raises(ConfigError, match=r"run.hosts\[0\] shares one process between rollout, eval.*rollout: a"):
        load_run_config(None, ["run.hosts=[[rollout, eval]]", "run.placement={rollout: a, eval: b}"])
    one = load_run_config(None, ["run.hosts=[[rollout, eval]]", "run.placement={rollout: gpu, trainer: cpu}"])
    assert one.run.placement == {"rollout": "gpu", "trainer": "cpu"}  # the Evaluator goes where its host goes
    services = {s.name: s for s in [_spec("rollout-0", "rollout"), _spec("eval", "eval")]}
    services["rollout-0"].resource = "gpu"
    assert [h.resource for h in shared_hosts(one.run.hosts, services)] == ["gpu"]


def _spec(name: str, role: str) -> ServiceSpec:
    return ServiceSpec(name, role, f"relax_services.services.x:{role.title()}Service", (), {})


def test_a_host_holds_every_service_of_its_roles_and_a_lone_one_keeps_its_actor() -> None:
    services = {s.name: s for s in [_spec("trainer", "trainer"), _spec("rollout-0", "rollout"), _spec("eval", "eval")]}
    services["rollout-1"] = _spec("rollout-1", "rollout")
    hosts = shared_hosts([["rollout", "eval", "reference"], ["trainer", "critic"]], services)
    assert [h.name for h in hosts] == ["host-rollout-0-eval-rollout-1"]
    assert [m.name for m in hosts[0].members] == ["rollout-0", "eval", "rollout-1"]
    assert services["trainer"].host is None  # its fellow role (critic) is not in this pipeline
    assert all(services[n].host is hosts[0] for n in ("rollout-0", "eval", "rollout-1"))
    assert group_class(["a:RolloutService", "b:EvalService"]).__name__ == "RolloutService_EvalService"


def test_the_host_routes_each_call_to_its_service_by_name() -> None:
    host = ServiceGroupHost.__new__(ServiceGroupHost)
    calls: list[tuple[str, object]] = []
    host.hosts = {
        "a": SimpleNamespace(report=lambda: calls.append(("a", None)) or ["ra"]),
        "b": SimpleNamespace(inject=lambda kind: calls.append(("b", kind))),
    }  # type: ignore[assignment]
    assert host.call("a", "report") == ["ra"]
    host.call("b", "inject", "raise")
    assert calls == [("a", None), ("b", "raise")]
    with pytest.raises(KeyError, match="service 'c' is not hosted here; members: a, b"):
        host.call("c", "report")
    with pytest.raises(AttributeError, match="no control method '_role'"):
        host.call("a", "_role", "pause")
    with pytest.raises(AttributeError, match="no control method 'nonesuch'"):
        host.call("a", "nonesuch")


def test_a_hosted_handle_calls_its_service_inside_the_host() -> None:
    sent: list[tuple[Any, ...]] = []
    actor = SimpleNamespace(call=SimpleNamespace(remote=lambda *a, **k: sent.append((*a, k)) or "ref"))
    handle = HostedHandle(actor, "eval")
    assert handle.evaluate_latest.remote() == "ref"
    handle.rebuild.remote("eval", 1, health="m")
    assert sent == [("eval", "evaluate_latest", {}), ("eval", "rebuild", "eval", 1, {"health": "m"})]
    assert handle.actor is actor


class _Host(SharedHost):
    """A host whose process is a counter: ``replace`` is a new process id; every member's loop starts in it."""

    def __init__(self, members: list[ServiceSpec], log: list[str]) -> None:
        super().__init__("host-r", members)
        self.log, self.process = log, 100
        self._point()

    def _point(self) -> None:
        pid = self.process
        for spec in self.members:
            spec.handle = SimpleNamespace(start=SimpleNamespace(remote=lambda pid=pid: pid))
            spec.host = self

    def replace(self, namespace: str) -> None:
        self.log.append(f"replace in {namespace}")
        self.restarts += 1
        self.process += 1
        self._point()


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    log: list[str] = []
    ray = SimpleNamespace(kill=lambda handle, no_restart: log.append("kill"), get=lambda ref, timeout=None: ref)
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setattr(time, "sleep", lambda s: log.append("sleep"))
    return log


def _pipeline(log: list[str], services: dict[str, ServiceSpec]) -> Any:
    forget = SimpleNamespace(remote=lambda name: log.append(f"forget {name}"))
    return SimpleNamespace(namespace="ns", health=SimpleNamespace(forget=forget), services=services)


def _restart_failed(manager: HealthManager, pipeline: Any, failed: dict[str, str]) -> None:
    """What :meth:`HealthManager.check` does with the services it judged failed."""
    for name, reason in failed.items():
        if name not in manager._restarting:
            manager._restart(pipeline, pipeline.services[name], reason)


def test_a_dead_host_restarts_every_role_it_held_in_one_new_process(fake_ray: list[str]) -> None:
    members = [_spec("rollout-0", "rollout"), _spec("eval", "eval"), _spec("reward", "reward")]
    host = _Host(members, fake_ray)
    services = {s.name: s for s in [*members, _spec("trainer", "trainer")]}
    for s in members:
        s.pid = 100
    manager = HealthManager(HealthConfig(restart_backoff_s=1.0))
    for name in ("rollout-0", "eval", "reward"):  # the report calls of all three failed: process gone
        manager._down_since[name] = 0.0
    failed = manager.judge({}, services, now=1.0)
    assert failed == {"rollout-0": "process died", "eval": "process died", "reward": "process died"}
    _restart_failed(manager, _pipeline(fake_ray, services), failed)
    manager.settle()
    assert fake_ray == ["forget rollout-0", "forget eval", "forget reward", "replace in ns", "sleep"]
    assert host.restarts == 1 and [s.restarts for s in members] == [1, 1, 1]
    restarted = [e for e in manager.events if e["event"] == "restarted"]
    assert [(e["service"], e["pid"], e["host"]) for e in restarted] == [
        ("rollout-0", 101, "host-r"),
        ("eval", 101, "host-r"),
        ("reward", 101, "host-r"),
    ]
    assert services["trainer"].restarts == 0


def test_a_raise_in_one_hosted_role_rebuilds_only_that_role(fake_ray: list[str]) -> None:
    members = [_spec("rollout-0", "rollout"), _spec("reward", "reward")]
    host = _Host(members, fake_ray)
    rebuilt: list[str] = []
    members[1].handle = SimpleNamespace(
        rebuild=SimpleNamespace(remote=lambda name, *a, **k: rebuilt.append(name) or 100)
    )
    manager = HealthManager(HealthConfig(restart_backoff_s=1.0))
    services = {s.name: s for s in members}
    beats = {"reward": {"pid": 100, "since_change_s": 0.1, "error": "RuntimeError: boom"}}
    failed = manager.judge(beats, services, now=1.0)  # type: ignore[arg-type]
    _restart_failed(manager, _pipeline(fake_ray, services), failed)
    manager.settle()
    assert rebuilt == ["reward"] and host.restarts == 0 and "replace in ns" not in fake_ray
    assert [s.restarts for s in members] == [0, 1]
    assert [(e["event"], e["service"]) for e in manager.events] == [("detected", "reward"), ("restarted", "reward")]
    assert manager.events[-1]["process"] == "same"


def test_a_hung_role_sharing_the_trainers_host_restarts_the_run(fake_ray: list[str]) -> None:
    members = [_spec("trainer", "trainer"), _spec("reference", "reference")]
    _Host(members, fake_ray)
    manager = HealthManager(HealthConfig())
    with pytest.raises(GlobalRestartNeeded, match="trainer failed: its host host-r failed with reference: hung"):
        manager._restart(_pipeline(fake_ray, {}), members[1], "hung")
    assert [(e["event"], e["service"]) for e in manager.events] == [("detected", "reference"), ("detected", "trainer")]


def test_a_host_death_during_a_fellow_members_rebuild_waits_for_that_rebuild(fake_ray: list[str]) -> None:
    """The reward's rebuild is in progress when the host dies: the others are judged again once it has ended (its
    failure is then a global restart), not restarted beside it by a second thread."""
    members = [_spec("rollout-0", "rollout"), _spec("reward", "reward")]
    _Host(members, fake_ray)
    manager = HealthManager(HealthConfig())
    manager._restarting["reward"] = SimpleNamespace(is_alive=lambda: True)  # type: ignore[assignment]
    manager._restart(_pipeline(fake_ray, {}), members[0], "process died")
    assert manager.events == [] and list(manager._restarting) == ["reward"] and fake_ray == []


def test_chaos_counts_a_kill_or_hang_beside_the_trainer_as_a_global_restart() -> None:
    from relax_services.chaos import global_restarts_needed
    from relax_services.config import FaultSpec

    faults = [
        FaultSpec(service="reference", kind="kill", at_step=2),
        FaultSpec(service="reference", kind="raise", at_step=3),  # rebuilt alone inside the host
        FaultSpec(service="rollout", kind="hang", at_step=4),
        FaultSpec(service="trainer", kind="raise", at_step=5),
    ]
    assert global_restarts_needed(faults) == 1
    assert global_restarts_needed(faults, [["rollout", "reference"]]) == 1
    assert global_restarts_needed(faults, [["trainer", "reference"], ["rollout", "eval"]]) == 2
