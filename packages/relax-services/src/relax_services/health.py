"""Health manager: detects crashed services (process gone), failed loops (an exception reported in a
heartbeat) and hung ones (progress counter frozen past the timeout), and restarts them in place with backoff.

Every event (injected, detected, restarted, recovered, gave up) is logged to the run's metrics.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

from relax_services._metrics import MetricsWriter
from relax_services.config import HealthConfig

if TYPE_CHECKING:
    from relax_services.pipeline import Pipeline, ServiceSpec

__all__ = ["GlobalRestartNeeded", "HealthManager", "ServiceGaveUpError"]


class ServiceGaveUpError(RuntimeError):
    """The run failed more often than ``health.max_global_restarts`` allows."""


class GlobalRestartNeeded(RuntimeError):
    """The Trainer failed, or a service exceeded its in-place restarts: restart everything from the last
    checkpoint."""


class HealthManager:
    """Watches the services of a pipeline (called from the controller loop)."""

    def __init__(self, cfg: HealthConfig, metrics: MetricsWriter | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.events: list[dict[str, Any]] = []
        self._down_since: dict[str, float] = {}
        self._started: dict[str, float] = {}

    def record_event(self, event: str, service: str, **details: Any) -> None:
        entry = {"event": event, "service": service, "time": time.time(), **details}
        self.events.append(entry)
        if self.metrics is not None:
            self.metrics.write("health", entry)

    def collect_reports(self, pipeline: Pipeline) -> dict[str, list[dict[str, Any]]]:
        """Drain every live service's metric records; a service whose process is gone is marked down."""
        import ray

        out: dict[str, list[dict[str, Any]]] = {}
        refs = {name: spec.handle.report.remote() for name, spec in pipeline.services.items() if spec.handle}
        for name, ref in refs.items():
            try:
                out[name] = ray.get(ref, timeout=30)
            except ray.exceptions.RayActorError:
                self._down_since.setdefault(name, time.monotonic())
                out[name] = []
            except ray.exceptions.GetTimeoutError:
                out[name] = []
        return out

    def check(self, pipeline: Pipeline) -> None:
        """Detect crashed, failed and hung services and restart them in place."""
        import ray

        beats = ray.get(pipeline.health.snapshot.remote(), timeout=30)
        now_wall = time.time()
        for name, spec in pipeline.services.items():
            reason = None
            if name in self._down_since:
                reason = "process died"
            else:
                beat = beats.get(name)
                started = self._started.get(name, 0.0)
                if beat is not None and beat.get("error"):
                    reason = f"work loop raised: {beat['error']}"
                elif (
                    beat is not None
                    and beat["pid"] == spec.pid
                    and now_wall - max(beat["changed"], started) > self.cfg.heartbeat_timeout_s
                ):
                    reason = f"no progress for {now_wall - beat['changed']:.0f}s (hung)"
            if reason is not None:
                self._restart(pipeline, spec, reason)

    def _restart(self, pipeline: Pipeline, spec: ServiceSpec, reason: str) -> None:
        import ray

        self.record_event("detected", spec.name, reason=reason)
        if spec.role == "trainer":  # its state lives in the last checkpoint: restart the whole run from there
            self._down_since.clear()
            raise GlobalRestartNeeded(f"trainer failed: {reason}")
        if spec.restarts >= self.cfg.max_restarts:
            self.record_event("gave_up", spec.name, restarts=spec.restarts)
            self._down_since.clear()
            raise GlobalRestartNeeded(f"service {spec.name} failed {spec.restarts + 1} times; last: {reason}")
        t0 = time.monotonic()
        with contextlib.suppress(Exception):  # already gone
            ray.kill(spec.handle, no_restart=True)
        time.sleep(self.cfg.restart_backoff_s * (2**spec.restarts))
        ray.get(pipeline.health.forget.remote(spec.name))
        spec.restarts += 1
        spec.create(pipeline.namespace)
        self._down_since.pop(spec.name, None)
        self._started[spec.name] = time.time()
        self.record_event("restarted", spec.name, restarts=spec.restarts, pid=spec.pid, seconds=time.monotonic() - t0)
