"""Health manager: detects crashed services (process gone), failed loops (an exception reported in a
heartbeat) and hung ones (progress counter frozen past the timeout), and restarts them in place with backoff.

Restarts are host-aware (``run.hosts``): a loop that raised is rebuilt alone inside its process, whoever shares it;
a process that died or must be replaced (a hang, or a rebuild that failed) takes every service it held, so all of
them restart together in a new one (a global restart when the Trainer is among them). What each restart counts
against ``health.max_restarts`` is :mod:`relax_services.faults.restart_counts`'s rule.

Every event (injected, detected, restarted, recovered, gave up) is logged to the run's metrics.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from relax_services.config import HealthConfig
from relax_services.faults.restart_counts import Counted, backoff_s, charged, restarted_event, spent
from relax_services.reporting.metrics import MetricsWriter

if TYPE_CHECKING:
    from relax_services.control.pipeline import Pipeline, ServiceSpec
    from relax_services.faults.monitor import Beat
    from relax_services.hosting.cohost import SharedHost

__all__ = ["GlobalRestartNeeded", "HealthManager", "ServiceGaveUpError", "memory_kill"]

_RAISED = "work loop raised: "
_MEMORY_WORDS = ("memory monitor", "due to memory pressure", "running low on memory")


def memory_kill(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is Ray's memory monitor killing a worker (its error texts)."""
    seen: BaseException | None = exc
    while seen is not None:
        text = str(seen).lower()
        if type(seen).__name__ == "OutOfMemoryError" or any(w in text for w in _MEMORY_WORDS):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class _Service(Protocol):
    """What judging a service needs of its record (a Ray-side ``ServiceSpec`` or an in-process service)."""

    @property
    def pid(self) -> int | None: ...


class ServiceGaveUpError(RuntimeError):
    """The run failed more often than ``health.max_global_restarts`` allows."""


class GlobalRestartNeeded(RuntimeError):
    """The Trainer failed, or a service or a shared host exceeded its in-place restarts: restart everything from the
    last checkpoint."""


class HealthManager:
    """Watches the services of a pipeline (called from the controller loop).

    Hangs are judged on monotonic clocks only: the monitor reports how long ago each service's progress counter
    last moved, measured in its own process (so neither a wall-clock jump nor another node's clock counts), and a
    service is never judged within ``heartbeat_timeout_s`` of being started or restarted (a new process imports,
    builds its model and waits for weights before its first progress). In-place restarts run on a thread, so the
    controller loop keeps reporting progress and watching the other services meanwhile.
    """

    def __init__(self, cfg: HealthConfig, metrics: MetricsWriter | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.events: list[dict[str, Any]] = []
        self._down_since: dict[str, float] = {}
        self._down_reason: dict[str, str] = {}
        self._started: dict[str, float] = {}  # service -> monotonic time it was (re)started
        self._restarting: dict[str, threading.Thread] = {}
        self._restart_errors: dict[str, BaseException] = {}
        # Hosted services whose rebuild failed inside their live host: judged failed again on the controller's
        # thread, where their host is replaced with every fellow member (the rebuild thread must not touch them).
        self._unbuilt: dict[str, str] = {}
        self._lock = threading.Lock()
        # Called (it may raise) before any service is restarted in place: the controller checks that the queues and
        # stores every service uses are alive, since a service failing because one of them died needs a global
        # restart instead.
        self.precheck: Callable[[], None] | None = None

    def record_event(self, event: str, service: str, **details: object) -> None:
        """Records one health event (a restart, a missed beat, ...) of ``service``, with a timestamp, in memory and in
        the run's metrics when it has them."""
        entry = {"event": event, "service": service, "time": time.time(), **details}
        with self._lock:
            self.events.append(entry)
            if self.metrics is not None:
                self.metrics.write("health", entry)

    def started(self, pipeline: Pipeline) -> None:
        """Every service of ``pipeline`` was (re)started now (a run's start or a global restart): grace for all."""
        now = time.monotonic()
        self._down_since.clear()
        self._unbuilt.clear()
        for name in pipeline.services:
            self._started[name] = now

    def admit(self, name: str) -> None:
        """Service ``name`` joined the running pipeline now (a Rollout replica added by ``relax scale``): it gets
        the start's grace before it can be judged hung."""
        self._started[name] = time.monotonic()

    def forget(self, name: str) -> None:
        """Service ``name`` left the pipeline for good (a replica removed by ``relax scale``): nothing is kept of it."""
        for state in (self._started, self._down_since, self._down_reason, self._unbuilt):
            state.pop(name, None)

    def busy(self, name: str) -> bool:
        """Whether service ``name`` is being restarted in place now."""
        thread = self._restarting.get(name)
        return thread is not None and thread.is_alive()

    def restarting(self) -> bool:
        """Whether an in-place restart is still in progress."""
        return any(t.is_alive() for t in self._restarting.values())

    def settle(self, timeout: float | None = None) -> None:
        """Wait for in-place restarts in progress (before the pipeline is torn down or rebuilt)."""
        for thread in list(self._restarting.values()):
            thread.join(timeout)
        self._restarting.clear()

    def collect_reports(self, pipeline: Pipeline) -> dict[str, list[dict[str, object]]]:
        """Drain every live service's metric records; a service whose process is gone is marked down."""
        import ray

        out: dict[str, list[dict[str, object]]] = {}
        refs = {
            name: spec.handle.report.remote()
            for name, spec in pipeline.services.items()
            if spec.handle and name not in self._restarting
        }
        for name, ref in refs.items():
            try:
                out[name] = ray.get(ref, timeout=30)
            except ray.exceptions.RayActorError as exc:
                self._down_since.setdefault(name, time.monotonic())
                if memory_kill(exc):
                    self._down_reason[name] = "killed by Ray's memory monitor (the node ran low on memory)"
                out[name] = []
            except ray.exceptions.GetTimeoutError:
                out[name] = []
        return out

    def check(self, pipeline: Pipeline) -> None:
        """Detect crashed, failed and hung services and restart them in place (on a thread)."""
        import ray

        self._finish_restarts()  # before judging: a hosted rebuild that failed is judged below
        beats = ray.get(pipeline.health.snapshot.remote(), timeout=30)
        failed = self.judge(beats, pipeline.services, time.monotonic())
        if failed and self.precheck is not None:
            self.precheck()
        for name, reason in failed.items():
            if name not in self._restarting:  # else restarted with a fellow member of its host just now
                self._restart(pipeline, pipeline.services[name], reason)

    def judge(self, beats: Mapping[str, Beat], services: Mapping[str, _Service], now: float) -> dict[str, str]:
        """Which services failed and why, from the monitor's ``snapshot`` and the monotonic time ``now``."""
        failed: dict[str, str] = {}
        for name, spec in services.items():
            if name in self._restarting:
                continue
            beat = beats.get(name)
            since_start = now - self._started.get(name, now)
            if name in self._down_since:
                failed[name] = self._down_reason.pop(name, "process died")
            elif name in self._unbuilt:
                failed[name] = self._unbuilt[name]
            elif beat is not None and beat.get("error"):
                failed[name] = f"{_RAISED}{beat['error']}"
            elif (
                beat is not None
                and beat["pid"] == spec.pid
                and since_start > self.cfg.heartbeat_timeout_s
                and beat["since_change_s"] > self.cfg.heartbeat_timeout_s
            ):
                failed[name] = f"no progress for {beat['since_change_s']:.0f}s (hung)"
        return failed

    def _finish_restarts(self) -> None:
        for name, thread in list(self._restarting.items()):
            if thread.is_alive():
                continue
            del self._restarting[name]
            error = self._restart_errors.pop(name, None)
            if error is not None:
                raise GlobalRestartNeeded(f"restart of {name} failed: {type(error).__name__}: {error}")
            if name in self._unbuilt:  # not restarted: judged failed again (see _restart_in_place)
                continue
            self._down_since.pop(name, None)
            self._started[name] = time.monotonic()

    def _restart(self, pipeline: Pipeline, spec: ServiceSpec, reason: str) -> None:
        """Restart ``spec`` in place on a thread: rebuilt in its process when its loop raised, else in a new process,
        which for a service sharing a host (``run.hosts``) is a new host for every member of it."""
        # A loop that raised left a live process with its model stack loaded: rebuild the service there first.
        rebuild = reason.startswith(_RAISED) and spec.name not in self._down_since
        host = None if rebuild else spec.host
        group = [spec] if host is None else host.members
        if any(other.name in self._restarting for other in group):
            return  # a fellow member's restart is in progress in this host: judged again once it has ended
        self.record_event("detected", spec.name, reason=reason)
        shared = f"its host {host.name} failed with {spec.name}: {reason}" if host is not None else reason
        for other in group:
            if other is not spec:  # its process ends with the host: it is restarted too
                self.record_event("detected", other.name, reason=shared)
        # After a failed rebuild the backoff was spent before it: the new process starts at once. Every member's
        # failed rebuild is settled by this restart.
        waited = bool([m for m in group if self._unbuilt.pop(m.name, None) is not None])
        trainer = next((s for s in group if s.role == "trainer"), None)
        if trainer is not None:  # its state lives in the last checkpoint: restart the whole run from there
            self._forget_failures()
            raise GlobalRestartNeeded(f"trainer failed: {reason if trainer is spec else shared}")
        counts = charged(spec, host, died=spec.name in self._down_since)
        used = spent(counts, self.cfg.max_restarts)
        if used is not None:
            self.record_event("gave_up", used.name, restarts=used.restarts)
            self._forget_failures()
            what = "service" if used is spec else "host"
            raise GlobalRestartNeeded(f"{what} {used.name} failed {used.restarts + 1} times; last: {reason}")
        work, label = (
            (partial(self._restart_host, pipeline, host, counts, waited), host.name)
            if host is not None
            else (partial(self._restart_in_place, pipeline, spec, rebuild), spec.name)
        )
        thread = threading.Thread(target=work, name=f"restart-{label}", daemon=True)
        for member in group:
            self._restarting[member.name] = thread
        thread.start()

    def _forget_failures(self) -> None:
        """A global restart replaces every service: what was judged of the old ones is moot."""
        self._down_since.clear()
        self._unbuilt.clear()

    def _restart_host(self, pipeline: Pipeline, host: SharedHost, counts: list[Counted], waited: bool = False) -> None:
        """Replace a host that died, hung or could not rebuild a member by a new process holding every member,
        built during the backoff, then start every member's work loop.

        Args:
            counts: What the restart counts against (:func:`~relax_services.faults.restart_counts.charged`): the host,
            and
                the member whose failure caused the replacement; each goes up by one, the others' stay.
            waited: The backoff was spent already (before a rebuild that failed): none now.
        """
        t0 = time.monotonic()
        backoff = 0.0 if waited else backoff_s(self.cfg.restart_backoff_s, counts)
        try:
            import ray

            for spec in host.members:
                ray.get(pipeline.health.forget.remote(spec.name), timeout=60)
            for count in counts:
                if count is not host:  # the host's own count goes up in replace(), with its new actor's name
                    count.restarts += 1
            host.replace(pipeline.namespace)
            time.sleep(max(0.0, backoff - (time.monotonic() - t0)))
            for spec in host.members:
                spec.start_loop()
        except BaseException as exc:  # handed to the controller loop (once for the host), which restarts the run
            self._restart_errors[host.members[0].name] = exc
            return
        for spec in host.members:
            self.record_event(
                "restarted", spec.name, **restarted_event(spec.restarts, spec.pid, time.monotonic() - t0, "new", host)
            )

    def _restart_in_place(self, pipeline: Pipeline, spec: ServiceSpec, rebuild: bool = False) -> None:
        """Restart ``spec`` after the backoff: rebuilt in its own process when ``rebuild`` (its loop raised), else
        (or when that fails) in a new process.

        A new process is created at once and imports the model stack and builds its engine (seconds to tens of
        seconds) while the backoff runs, so that restart takes the longer of the two rather than their sum; the
        backoff still spaces the work loops of a service that keeps failing.
        """
        t0 = time.monotonic()
        backoff = backoff_s(self.cfg.restart_backoff_s, [spec])
        try:
            if rebuild:
                error = self._rebuild(pipeline, spec, backoff)
                if error is not None and spec.host is not None:
                    # Its fellow members share the process a replacement ends, and this thread does not own their
                    # restarts: the controller's thread judges it again and replaces the host with all of them.
                    self._unbuilt[spec.name] = f"its rebuild inside host {spec.host.name} failed: {error}"
                    return
                rebuild = error is None
            if not rebuild:
                self._replace(pipeline, spec, backoff, t0)
        except BaseException as exc:  # handed to the controller loop, which restarts the run
            self._restart_errors[spec.name] = exc
            return
        self.record_event(
            "restarted",
            spec.name,
            **restarted_event(spec.restarts, spec.pid, time.monotonic() - t0, "same" if rebuild else "new", spec.host),
        )

    def _rebuild(self, pipeline: Pipeline, spec: ServiceSpec, backoff: float) -> str | None:
        """Rebuild the service in its live process (no new imports); returns None, or why that failed."""
        import ray

        time.sleep(backoff)
        try:
            ray.get(pipeline.health.forget.remote(spec.name), timeout=60)
            spec.pid = int(ray.get(spec.handle.rebuild.remote(spec.name, *spec.args, **spec.kwargs), timeout=300))
        except Exception as exc:  # a broken process: replace it
            lines = str(exc).strip().splitlines()  # a Ray task error: the remote traceback, its exception last
            return lines[-1] if lines else type(exc).__name__
        spec.restarts += 1
        return None

    def _replace(self, pipeline: Pipeline, spec: ServiceSpec, backoff: float, t0: float) -> None:
        """Kill the service's process and start a new one, built during what is left of the backoff."""
        import ray

        with contextlib.suppress(Exception):  # already gone
            ray.kill(spec.handle, no_restart=True)
        ray.get(pipeline.health.forget.remote(spec.name), timeout=60)
        spec.restarts += 1
        spec.spawn(pipeline.namespace)
        time.sleep(max(0.0, backoff - (time.monotonic() - t0)))
        spec.start_loop()
