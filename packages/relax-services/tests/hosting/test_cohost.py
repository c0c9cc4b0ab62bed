"""Roles sharing one process (``run.hosts``): the config's rules, the host's call routing, and the health manager's
host-aware restarts (a raise rebuilds one role in its host; a dead or hung host restarts every role it held)."""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace
from typing import Any

import pytest

from relax_core import ConfigError
from relax_services.config import HealthConfig, load_run_config
from relax_services.control.pipeline import ServiceSpec, shared_hosts
from relax_services.faults.health import GlobalRestartNeeded, HealthManager
from relax_services.hosting.cohost import HostedHandle, ServiceGroupHost, SharedHost, group_class


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


def test_a_host_holds_its_roles_first_replica_only_and_a_lone_one_keeps_its_actor() -> None:
    services = {s.name: s for s in [_spec("trainer", "trainer"), _spec("rollout-0", "rollout"), _spec("eval", "eval")]}
    services["rollout-1"] = _spec("rollout-1", "rollout")
    services["rollout-12"] = _spec("rollout-12", "rollout")
    hosts = shared_hosts([["rollout", "eval", "reference"], ["trainer", "critic"]], services)
    assert [h.name for h in hosts] == ["host-rollout-0-eval"]
    assert [m.name for m in hosts[0].members] == ["rollout-0", "eval"]
    assert services["trainer"].host is None  # its fellow role (critic) is not in this pipeline
    assert all(services[n].host is hosts[0] for n in ("rollout-0", "eval"))
    # Replicas never share a process: every replica after the first has an actor of its own.
    assert services["rollout-1"].host is None and services["rollout-12"].host is None
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
    # The process died, not a role in it: the host's count goes up, its roles' own counts stay.
    assert host.restarts == 1 and [s.restarts for s in members] == [0, 0, 0]
    restarted = [e for e in manager.events if e["event"] == "restarted"]
    assert [(e["service"], e["pid"], e["host"], e["host_restarts"]) for e in restarted] == [
        ("rollout-0", 101, "host-r", 1),
        ("eval", 101, "host-r", 1),
        ("reward", 101, "host-r", 1),
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
    from relax_services.bench.chaos import global_restarts_needed
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


@pytest.fixture
def timed_ray(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """:func:`fake_ray` whose log shows each wait's length, on a monotonic clock that stands still (a restart's
    build then takes no time, so each wait is the whole backoff)."""
    log: list[str] = []
    ray = SimpleNamespace(kill=lambda handle, no_restart: log.append("kill"), get=lambda ref, timeout=None: ref)
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setattr(time, "sleep", lambda s: log.append(f"sleep {s:g}"))
    monkeypatch.setattr(time, "monotonic", lambda: 100.0)
    return log


def _failing_rebuild(spec: ServiceSpec, log: list[str]) -> None:
    """``spec``'s rebuild raises inside its host, as Ray hands back an exception the service raised there."""

    def rebuild(name: str, *args: object, **kwargs: object) -> int:
        log.append(f"rebuild {name}")
        raise RuntimeError(f"Traceback ...\nRuntimeError: {name}: injected fault 'break'")

    spec.handle = SimpleNamespace(rebuild=SimpleNamespace(remote=rebuild))


def _working_rebuild(spec: ServiceSpec, log: list[str], pid: int) -> None:
    spec.handle = SimpleNamespace(
        rebuild=SimpleNamespace(remote=lambda name, *a, **k: log.append(f"rebuild {name}") or pid)
    )


def _check(manager: HealthManager, pipeline: Any, beats: dict[str, Any], now: float = 1000.0) -> None:
    """One :meth:`HealthManager.check` of the controller loop (the monitor's snapshot given), then the restarts it
    began run to their end."""
    manager._finish_restarts()
    _restart_failed(manager, pipeline, manager.judge(beats, pipeline.services, now))
    for thread in list(manager._restarting.values()):
        thread.join()


def _raised(name: str, pid: int) -> dict[str, Any]:
    return {name: {"pid": pid, "since_change_s": 0.1, "error": "RuntimeError: injected fault"}}


def test_a_failed_rebuild_inside_a_host_replaces_the_host_with_every_member(timed_ray: list[str]) -> None:
    members = [_spec("rollout-0", "rollout"), _spec("eval", "eval"), _spec("reward", "reward")]
    host = _Host(members, timed_ray)
    for s in members:
        s.pid = 100
    _failing_rebuild(members[2], timed_ray)
    services = {s.name: s for s in [*members, _spec("trainer", "trainer")]}
    pipeline = _pipeline(timed_ray, services)
    manager = HealthManager(HealthConfig(restart_backoff_s=1.0))
    _check(manager, pipeline, _raised("reward", 100))  # the rebuild thread: the backoff, then the rebuild fails
    assert timed_ray == ["sleep 1", "forget reward", "rebuild reward"] and host.restarts == 0
    _check(manager, pipeline, {})  # judged again on the controller's thread: the host is replaced
    # The backoff was spent before the rebuild: the new process's loops start at once (a wait of 0).
    assert timed_ray[3:] == ["forget rollout-0", "forget eval", "forget reward", "replace in ns", "sleep 0"]
    manager._finish_restarts()
    assert not manager._restarting and not manager._unbuilt
    # The host's count and the reward's (whose failure it was) went up; its fellow members' did not.
    assert (host.restarts, [s.restarts for s in members]) == (1, [0, 0, 1])
    detected = [(e["service"], e["reason"]) for e in manager.events if e["event"] == "detected"]
    unbuilt = "its rebuild inside host host-r failed: RuntimeError: reward: injected fault 'break'"
    assert detected == [
        ("reward", "work loop raised: RuntimeError: injected fault"),
        ("reward", unbuilt),
        ("rollout-0", f"its host host-r failed with reward: {unbuilt}"),
        ("eval", f"its host host-r failed with reward: {unbuilt}"),
    ]
    restarted = [e for e in manager.events if e["event"] == "restarted"]
    assert [(e["service"], e["pid"], e["process"], e["restarts"]) for e in restarted] == [
        ("rollout-0", 101, "new", 0),
        ("eval", 101, "new", 0),
        ("reward", 101, "new", 1),
    ]
    assert services["trainer"].restarts == 0
    assert not [e for e in manager.events if e["event"] == "gave_up"]


def test_a_failed_rebuild_in_the_trainers_host_restarts_the_run(timed_ray: list[str]) -> None:
    members = [_spec("trainer", "trainer"), _spec("reference", "reference")]
    _Host(members, timed_ray)
    members[1].pid = 100
    _failing_rebuild(members[1], timed_ray)
    pipeline = _pipeline(timed_ray, {s.name: s for s in members})
    manager = HealthManager(HealthConfig())
    _check(manager, pipeline, _raised("reference", 100))
    with pytest.raises(GlobalRestartNeeded, match="trainer failed: its host host-r failed with reference: its rebuild"):
        _check(manager, pipeline, {})
    assert "replace in ns" not in timed_ray and not manager._unbuilt


def test_restarts_count_against_the_role_that_failed_and_the_host_that_was_replaced(timed_ray: list[str]) -> None:
    """``health.max_restarts=2``, backoff 1 s doubling. By hand: the Reward raises twice (rebuilt in the host, its
    count 1 then 2, waits 1 and 2 s); the host dies (the host's count 0 → 1, wait 1 s; the Reward's 2 stays, so it is
    not spent); the Rollout hangs (the host 1 → 2 and the Rollout 0 → 1, wait 2^max(1, 0) = 2 s); the host dies
    again: its count 2 is spent, a global restart. Counting every member for a host's replacement, the Reward would
    have been spent at the first death."""
    rollout, reward = _spec("rollout-0", "rollout"), _spec("reward", "reward")
    host = _Host([rollout, reward], timed_ray)
    rollout.pid = reward.pid = 100
    services = {"rollout-0": rollout, "reward": reward}
    pipeline = _pipeline(timed_ray, services)
    manager = HealthManager(HealthConfig(max_restarts=2, restart_backoff_s=1.0))

    def waits() -> list[str]:
        return [entry for entry in timed_ray if entry.startswith("sleep")]

    for raised in (1, 2):
        _working_rebuild(reward, timed_ray, 100)
        _check(manager, pipeline, _raised("reward", 100))
        assert (reward.restarts, host.restarts) == (raised, 0)
    assert waits() == ["sleep 1", "sleep 2"]

    manager._finish_restarts()
    manager._down_since.update({"rollout-0": 0.0, "reward": 0.0})  # both report calls failed: the process is gone
    _check(manager, pipeline, {})
    assert (host.restarts, reward.restarts, rollout.restarts) == (1, 2, 0)
    assert waits()[2:] == ["sleep 1"] and rollout.pid == reward.pid == 101

    hung = {"rollout-0": {"pid": 101, "since_change_s": 40.0, "error": None}}
    _check(manager, pipeline, hung)  # judged 900 s after its restart, 40 s without progress: hung
    assert (host.restarts, reward.restarts, rollout.restarts) == (2, 2, 1)
    assert waits()[3:] == ["sleep 2"]

    manager._finish_restarts()
    manager._down_since.update({"rollout-0": 0.0, "reward": 0.0})
    with pytest.raises(GlobalRestartNeeded, match="host host-r failed 3 times; last: process died"):
        _check(manager, pipeline, {})
    assert [(e["service"], e["restarts"]) for e in manager.events if e["event"] == "gave_up"] == [("host-r", 2)]
    restarted = [
        (e["service"], e["process"], e["restarts"], e["host_restarts"])
        for e in manager.events
        if e["event"] == "restarted"
    ]
    assert restarted == [
        ("reward", "same", 1, 0),
        ("reward", "same", 2, 0),
        ("rollout-0", "new", 0, 1),
        ("reward", "new", 2, 1),
        ("rollout-0", "new", 1, 2),
        ("reward", "new", 2, 2),
    ]


def test_every_restarted_event_has_one_shape(timed_ray: list[str]) -> None:
    """A rebuild in place, a new process of its own and a host's replacement record the same fields."""
    from relax_services.control.colocated import LocalHealthManager, LocalService

    fields = {"event", "service", "time", "restarts", "pid", "seconds", "process", "host", "host_restarts"}
    alone, hosted = _spec("reward", "reward"), _spec("eval", "eval")
    _Host([hosted, _spec("rollout-0", "rollout")], timed_ray)
    alone.pid, hosted.pid = 7, 100
    _working_rebuild(alone, timed_ray, 7)
    pipeline = _pipeline(timed_ray, {"reward": alone, "eval": hosted, "rollout-0": hosted.host.members[1]})
    manager = HealthManager(HealthConfig(restart_backoff_s=0.0))
    _check(manager, pipeline, _raised("reward", 7))  # rebuilt in its own process
    manager._finish_restarts()
    manager._down_since["eval"] = 0.0
    _check(manager, pipeline, {})  # its host replaced
    shapes = [set(e) for e in manager.events if e["event"] == "restarted"]
    assert len(shapes) == 3 and all(shape == fields for shape in shapes)

    class Loop:  # a colocated service whose restart builds this object again
        def __init__(self, name: str) -> None:
            self.name = name

        def start(self) -> int:
            return 5

    local = LocalHealthManager(HealthConfig(restart_backoff_s=0.0))
    service = LocalService("reward", "reward", Loop, ())
    local._restart(SimpleNamespace(health=SimpleNamespace(forget=lambda name: None)), service, "hung")  # type: ignore[arg-type]
    colocated = next(e for e in local.events if e["event"] == "restarted")
    assert set(colocated) == fields and (colocated["process"], colocated["host"]) == ("same", None)
