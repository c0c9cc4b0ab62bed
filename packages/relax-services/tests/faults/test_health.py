"""Hang detection: durations on monotonic clocks only, and grace after any (re)start."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from relax_services.config import HealthConfig
from relax_services.faults.health import HealthManager
from relax_services.services._base import HealthMonitor


def test_the_monitor_reports_ages_on_its_monotonic_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wall-clock jump (a paused machine: time.time() +41 s while the monotonic clock moved 2.3 s) is no hang."""
    clock = {"mono": 100.0, "wall": 5000.0}
    monkeypatch.setattr(time, "monotonic", lambda: clock["mono"])
    monkeypatch.setattr(time, "time", lambda: clock["wall"])
    monitor = HealthMonitor()
    monitor.beat("rollout-0", progress=1, pid=7)
    clock["mono"] += 2.3
    clock["wall"] += 41.0
    beat = monitor.snapshot()["rollout-0"]
    assert beat["since_change_s"] == pytest.approx(2.3) and beat["since_beat_s"] == pytest.approx(2.3)
    monitor.beat("rollout-0", progress=1, pid=7)  # alive, no progress
    clock["mono"] += 1.0
    beat = monitor.snapshot()["rollout-0"]
    assert beat["since_change_s"] == pytest.approx(3.3) and beat["since_beat_s"] == pytest.approx(1.0)


def _services(**pids: int) -> dict[str, Any]:
    return {name: SimpleNamespace(pid=pid, role=name.split("-")[0]) for name, pid in pids.items()}


def test_no_hang_is_declared_within_the_timeout_of_a_restart() -> None:
    """The false 'rollout-0 hung' 6 s after a global restart: the new process had not made progress yet."""
    manager = HealthManager(HealthConfig(heartbeat_timeout_s=6.0))
    services = _services(**{"rollout-0": 11, "reward-0": 12})
    pipeline = SimpleNamespace(services=services)
    t0 = time.monotonic()
    manager.started(pipeline)
    stuck = {"rollout-0": {"pid": 11, "since_change_s": 6.5, "error": None}}
    assert manager.judge(stuck, services, now=t0 + 5.0) == {}  # within the grace after its start
    assert manager.judge({"rollout-0": {**stuck["rollout-0"], "since_change_s": 5.0}}, services, t0 + 30) == {}
    assert manager.judge(stuck, services, now=t0 + 7.0) == {"rollout-0": "no progress for 6s (hung)"}
    assert manager.judge({"rollout-0": {"pid": 99, "since_change_s": 60.0}}, services, t0 + 70) == {}  # old pid
    raised = {"reward-0": {"pid": 12, "since_change_s": 0.1, "error": "RuntimeError: boom"}}
    assert manager.judge(raised, services, now=t0 + 1.0) == {"reward-0": "work loop raised: RuntimeError: boom"}


def test_the_monitor_actor_does_not_import_the_model_stack() -> None:
    """Its process imports only its own module (it used to import every service, torch and transformers)."""
    import subprocess
    import sys

    probe = "import sys, relax_services.faults.monitor; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_memory_monitor_kills_are_recognised() -> None:
    """Ray's own words when its memory monitor kills a worker (from the raylet), through an exception chain."""
    from relax_services.faults.health import memory_kill

    try:
        try:
            raise RuntimeError("1 worker(s) were killed due to the node running low on memory.")
        except RuntimeError as inner:
            raise ValueError("service reward-0 failed 4 times; last: process died") from inner
    except ValueError as outer:
        assert memory_kill(outer)
    assert memory_kill(RuntimeError("last: killed by Ray's memory monitor (the node ran low on memory)"))
    assert not memory_kill(RuntimeError("process died"))


def test_a_restart_builds_the_new_process_during_the_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """The replacement is created (its process imports the model stack and builds its engine) before the backoff
    wait, and only its work loop waits for the backoff: a restart costs max(backoff, start-up), not their sum."""
    import sys

    events: list[str] = []
    fake_ray = SimpleNamespace(kill=lambda handle, no_restart: events.append("kill"), get=lambda ref, timeout: ref)
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", lambda s: (slept.append(s), events.append("sleep")))

    class Spec:
        name, role, restarts, pid, handle = "rollout-0", "rollout", 1, 11, object()
        host = None  # an actor of its own

        def spawn(self, namespace: str) -> None:
            events.append(f"spawn {namespace} after {self.restarts} restarts")

        def start_loop(self) -> int:
            events.append("start loop")
            self.pid = 12
            return self.pid

    forget = SimpleNamespace(remote=lambda name: events.append(f"forget {name}"))
    pipeline = SimpleNamespace(namespace="ns", health=SimpleNamespace(forget=forget))
    manager = HealthManager(HealthConfig(restart_backoff_s=4.0))
    spec = Spec()
    manager._restart_in_place(pipeline, spec)  # type: ignore[arg-type]
    assert events == ["kill", "forget rollout-0", "spawn ns after 2 restarts", "sleep", "start loop"]
    assert 0.0 <= slept[0] <= 8.0  # backoff 4 s × 2 ** 1 (its second restart), less what the steps before took
    assert manager.events[-1]["event"] == "restarted" and manager.events[-1]["pid"] == 12


class _Counting:
    """A real service (ServiceBase's loop, no Ray) that counts its constructions and steps."""

    built = 0


def _counting_service() -> Any:
    from relax_services.services._base import ServiceBase

    class Counting(ServiceBase):
        def __init__(self, name: str, tag: str, *, health: None = None) -> None:
            super().__init__(name, health)
            self.tag = tag
            self.steps = 0
            _Counting.built += 1

        def step(self) -> None:
            self.steps += 1
            self._stop.wait(0.01)

    return Counting("reward", "t", health=None)


def _wait_until(condition: Any) -> None:
    while not condition():  # the test's own loop: bounded by pytest's timeout, not asserted on time
        time.sleep(0.01)


def test_a_service_whose_loop_raised_is_rebuilt_in_its_process() -> None:
    _Counting.built = 0
    service = _counting_service()
    service.start()
    _wait_until(lambda: service.steps > 0)
    with pytest.raises(RuntimeError, match="still running"):  # a live (or hung) loop: only a new process ends it
        service.rebuild("reward", "t", health=None)
    service.inject("raise")
    _wait_until(lambda: service.status()["error"] is not None)
    assert service.status()["error"] == "RuntimeError: injected fault in reward"
    assert service.rebuild("reward", "t", health=None) == service.pid()
    assert _Counting.built == 2 and service.tag == "t"  # built again with its original arguments
    assert service.status()["error"] is None
    _wait_until(lambda: service.steps > 0)  # a new loop runs, on fresh state
    assert service.stop()


def _fake_restart_setup(monkeypatch: pytest.MonkeyPatch, rebuild_fails: bool) -> tuple[list[str], Any, Any]:
    import sys

    events: list[str] = []
    fake_ray = SimpleNamespace(kill=lambda handle, no_restart: events.append("kill"), get=lambda ref, timeout: ref)
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    monkeypatch.setattr(time, "sleep", lambda s: events.append("sleep"))

    def rebuild(name: str, *args: object, **kwargs: object) -> int:
        events.append(f"rebuild {name} {args} {sorted(kwargs)}")
        if rebuild_fails:
            raise RuntimeError("broken process")
        return 11

    class Spec:
        name, role, restarts, pid = "reward", "reward", 0, 11
        host = None  # an actor of its own
        args, kwargs = ("cfg", "queue"), {"health": "monitor"}
        handle = SimpleNamespace(rebuild=SimpleNamespace(remote=rebuild))

        def spawn(self, namespace: str) -> None:
            events.append("spawn")

        def start_loop(self) -> int:
            events.append("start loop")
            self.pid = 12
            return self.pid

    forget = SimpleNamespace(remote=lambda name: events.append("forget"))
    return events, Spec(), SimpleNamespace(namespace="ns", health=SimpleNamespace(forget=forget))


REBUILD = "rebuild reward ('cfg', 'queue') ['health']"  # with the arguments the service was created with


@pytest.mark.parametrize("rebuild_fails", [False, True])
def test_a_raised_loop_is_rebuilt_in_place_and_a_failed_rebuild_replaces_the_process(
    monkeypatch: pytest.MonkeyPatch, rebuild_fails: bool
) -> None:
    events, spec, pipeline = _fake_restart_setup(monkeypatch, rebuild_fails)
    manager = HealthManager(HealthConfig(restart_backoff_s=1.0))
    reason = manager.judge({"reward": {"pid": 11, "since_change_s": 0.1, "error": "E: x"}}, {"reward": spec}, 0.0)
    manager._restart(pipeline, spec, reason["reward"])  # type: ignore[arg-type]
    manager.settle()
    last = manager.events[-1]
    if rebuild_fails:  # the backoff was spent before the rebuild: the new process starts at once
        assert events == ["sleep", "forget", REBUILD, "kill", "forget", "spawn", "sleep", "start loop"]
        assert last["process"] == "new" and last["pid"] == 12
    else:
        assert events == ["sleep", "forget", REBUILD]  # no kill, no new process
        assert last["process"] == "same" and last["pid"] == 11
    assert last["event"] == "restarted" and spec.restarts == 1


def test_an_in_place_restart_does_not_block_the_controller_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The restart (a new process importing the model stack: seconds to tens of seconds) runs on a thread: the
    call that starts it returns while the new process is still being built, and the loop goes on meanwhile."""
    import sys
    import threading

    fake_ray = SimpleNamespace(kill=lambda handle, no_restart: None, get=lambda ref, timeout: ref)
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    release, building = threading.Event(), threading.Event()

    class Spec:
        name, role, restarts, pid, handle = "reward", "reward", 0, 11, object()
        host = None  # an actor of its own

        def spawn(self, namespace: str) -> None:
            building.set()
            release.wait(120)  # the new process's imports, until the test lets them end

        def start_loop(self) -> int:
            self.pid = 12
            return self.pid

    pipeline = SimpleNamespace(namespace="ns", health=SimpleNamespace(forget=SimpleNamespace(remote=lambda n: None)))
    manager = HealthManager(HealthConfig(restart_backoff_s=0.0))
    manager._restart(pipeline, Spec(), "process died")  # type: ignore[arg-type]
    building.wait(120)
    assert manager.restarting(), "the restart ended before its new process was built: it blocked the caller"
    assert [e["event"] for e in manager.events] == ["detected"]
    release.set()
    manager.settle()
    assert not manager.restarting()
    assert [e["event"] for e in manager.events] == ["detected", "restarted"] and manager.events[-1]["pid"] == 12
