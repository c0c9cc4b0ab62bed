"""Live scaling of the Rollout replicas: ``relax scale RUN_DIR rollout=N`` and ``rollout.autoscale``.

:class:`ReplicaScaling` is a part of the :class:`~relax_services.control.controller.Controller` (as its checkpoints
and global restarts are): the controller's loop carries out each request of its control endpoint
(:mod:`relax_services.control.endpoint`) and each decision of its :class:`~relax_services.control.autoscale.
Autoscaler` between two ticks, so one scaling operation runs at a time and the health manager never sees a replica
half-added. Every transition is a ``scale`` record in ``metrics.jsonl`` (``event``: ``requested``,
``join_started``, ``joined``, ``join_failed``, ``drain_started``, ``removed``, ``done``; ``failed`` and
``autoscale_failed`` when an operation broke).

- **Scale-out** adds the lowest free replica name (``rollout-1``, ...) as a process of its own with the arguments of
  ``rollout-0`` (with ``trainer.weight_sync=broadcast``: the store's handle of its own slot, which it registers in
  the broadcast group, joining at the next version). The process builds itself and pulls the newest weights; it is
  admitted (its work loop started, so it leases prompts) only once it holds the Trainer's published version. A
  replica that fails to build or to reach that version within :data:`JOIN_TIMEOUT_S` is killed and the operation
  rolled back (``join_failed``): it never took a prompt, so it never served old weights as new.
- **Scale-in** drains the highest-numbered replica: its loop finishes the call in progress (samples put, prompts
  acknowledged; prompts leased while it still waited for weights go back to the queue), its last records are
  collected, then its process ends and its broadcast slot leaves the group. A drain past :data:`DRAIN_TIMEOUT_S`
  ends the process anyway: its leases expire and the queue redelivers them (nothing lost, nothing acknowledged
  twice). ``rollout-0`` is never removed (the count is at least 1).
- The admission formula counts samples, not replicas (``(τ + V + 1)·B − (accepted + running)``): it holds for any
  count, and a drained replica holds no admitted work. The new count is written into the run's config in memory, so a
  global restart rebuilds the pipeline with it.

Light: Ray is imported inside the methods.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from relax_services.config.services import MAX_REPLICAS
from relax_services.control.autoscale import Autoscaler, UpdateWaits
from relax_services.control.endpoint import ControlEndpoint, PendingRequest
from relax_services.control.pipeline import ServiceSpec
from relax_services.faults.actor_watch import actor_lost
from relax_services.faults.health import GlobalRestartNeeded
from relax_services.hosting.placement import replica_name
from relax_services.weights.broadcast_store import BroadcastWeightStore

if TYPE_CHECKING:
    from pathlib import Path

    from relax_services.config import RunConfig
    from relax_services.control.pipeline import Pipeline
    from relax_services.faults.health import HealthManager
    from relax_services.reporting.metrics import MetricsWriter

__all__ = ["DRAIN_TIMEOUT_S", "JOIN_TIMEOUT_S", "ReplicaScaling", "ScaleError"]

JOIN_TIMEOUT_S = 300.0
"""Seconds a new replica has to build itself and hold the Trainer's version before its join is rolled back."""

DRAIN_TIMEOUT_S = 60.0
"""Seconds a draining replica has to finish its call in progress before its process is ended anyway."""


def _seconds(value: object) -> float:
    """A record's seconds field as a float (0 for a missing or non-numeric value)."""
    return float(value) if isinstance(value, int | float) else 0.0


class ScaleError(RuntimeError):
    """A scaling request that cannot be carried out (the message says why and what to do)."""


class ReplicaScaling:
    """The controller's replica scaling (see the module). Reads the controller's ``cfg``, ``pipeline``, ``health``,
    ``metrics`` and ``run_dir``, and calls its ``clock``, ``_ingest`` and ``_between_steps``."""

    cfg: RunConfig
    pipeline: Pipeline
    health: HealthManager
    metrics: MetricsWriter
    run_dir: Path
    _stop_reason: str | None
    clock: Callable[[], float]  # the run's clock
    _ingest: Callable[[dict[str, Any]], None]  # handles one service record
    _between_steps: Callable[[], None]  # what the loop keeps doing while a replica joins or drains

    # ------------------------------------------------------------------ set-up, per tick
    def _open_scaling(self) -> None:
        """Serve the control endpoint and start the autoscaler (when ``rollout.autoscale.enabled``)."""
        self._endpoint: ControlEndpoint | None = ControlEndpoint(self.run_dir)
        auto = self.cfg.rollout.autoscale
        self._autoscaler = Autoscaler(auto, start_s=self.clock()) if auto.enabled else None
        self._rollout_busy_s = 0.0
        self._rollout_blocked_s = 0.0

    def _close_scaling(self) -> None:
        endpoint = getattr(self, "_endpoint", None)
        if endpoint is not None:
            endpoint.close()
            self._endpoint = None

    def _observe_waits(self, kind: str, record: Mapping[str, object]) -> None:
        """Feed the autoscaler: replica seconds from ``rollout`` records, one window entry per ``train`` record."""
        if getattr(self, "_autoscaler", None) is None:
            return
        if kind == "rollout":
            self._rollout_busy_s += _seconds(record["seconds"])
            self._rollout_blocked_s += _seconds(record.get("blocked_s", 0.0))
        elif kind == "train":
            assert self._autoscaler is not None
            self._autoscaler.observe(
                UpdateWaits(
                    _seconds(record["wait_s"]),
                    _seconds(record["train_s"]),
                    self._rollout_busy_s,
                    self._rollout_blocked_s,
                )
            )
            self._rollout_busy_s = self._rollout_blocked_s = 0.0

    def _scale_tick(self) -> None:
        """Carry out a pending ``relax scale`` request, then what the autoscaler decides (one operation a tick)."""
        pending = None if self._endpoint is None else self._endpoint.pending()
        if pending is not None:
            self._serve(pending)
            return
        if self._autoscaler is None or self._stop_reason is not None:
            return
        current = len(self.replicas())
        target = self._autoscaler.decide(self.clock(), current)
        if target is not None:
            wait_share, blocked_share = self._autoscaler.shares()
            try:
                self.scale_rollout(
                    target, reason=f"autoscale: trainer wait {wait_share:.2f}, replicas blocked {blocked_share:.2f}"
                )
            except Exception as exc:  # a failed join was rolled back: the cool-down spaces the next try
                self._unless_restart(exc)
                self._autoscaler.changed(self.clock())
                self._scale_event("autoscale_failed", error=f"{type(exc).__name__}: {exc}")

    def _serve(self, pending: PendingRequest) -> None:
        request = pending.request
        try:
            if request.get("op") != "scale":
                raise ScaleError(f"unknown request {request.get('op')!r}; the driver serves 'scale'")
            role = request.get("role")
            if role != "rollout":
                raise ScaleError(f"only the rollout role scales (rollout=N), got {role!r}")
            count = request.get("count")
            if not isinstance(count, int) or isinstance(count, bool):
                raise ScaleError(f"rollout={count!r}: the count is a whole number")
            pending.reply({"ok": True, **self.scale_rollout(count, reason="relax scale")})
        except ScaleError as exc:
            pending.reply({"error": str(exc)})
        except Exception as exc:  # the requester learns what broke; the run goes on unless it needs a restart
            pending.reply({"error": f"scaling failed: {type(exc).__name__}: {exc}"})
            self._unless_restart(exc)
            self._scale_event("failed", error=f"{type(exc).__name__}: {exc}")

    @staticmethod
    def _unless_restart(exc: Exception) -> None:
        """Re-raise ``exc`` when the run needs a global restart (the loop's watching found one, or an actor the
        pipeline shares died): a scaling error must not hide it, nor stop the run when it is the scaling's own."""
        if isinstance(exc, GlobalRestartNeeded) or actor_lost(exc):
            raise exc

    # ------------------------------------------------------------------ the operation
    def replicas(self) -> list[str]:
        """The names of the pipeline's Rollout replicas, in index order."""
        names = [name for name, spec in self.pipeline.services.items() if spec.role == "rollout"]
        return sorted(names, key=lambda name: int(name.rpartition("-")[2]))

    def scale_rollout(self, count: int, reason: str) -> dict[str, object]:
        """Add or remove Rollout replicas, one at a time, until there are ``count``.

        Returns:
            ``from``, ``to`` (the counts), ``seconds`` and the replicas ``added`` and ``removed``.

        Raises:
            ScaleError: a count below 1 or above :data:`MAX_REPLICAS`, a colocated or GPU-placed run, a run that is
                stopping, a replica being restarted, or a join that failed (rolled back; the replicas added before
                it stay).
        """
        if self.cfg.run.mode == "colocated":
            raise ScaleError(
                "this run is in colocated mode (every service a thread of the driver): its rollout cannot scale; "
                "run with run.mode=distributed"
            )
        if count < 1:
            raise ScaleError(f"rollout={count}: a run keeps at least 1 rollout replica")
        if count > MAX_REPLICAS:
            raise ScaleError(f"rollout={count}: at most {MAX_REPLICAS} rollout replicas")
        if self.pipeline.placement is not None:
            raise ScaleError(
                "this run places its processes in GPU placement groups fixed at its start: replicas cannot be added "
                "or removed while it runs (set rollout.replicas and resume)"
            )
        if self._stop_reason is not None:
            raise ScaleError(f"the run is stopping ({self._stop_reason})")
        start, before = time.monotonic(), len(self.replicas())
        self._scale_event("requested", before=before, count=count, reason=reason)
        added: list[str] = []
        removed: list[str] = []
        try:
            while len(self.replicas()) < count:
                added.append(self._add_replica())
            while len(self.replicas()) > count:
                removed.append(self._remove_replica())
        finally:
            now_count = len(self.replicas())
            rollout = self.cfg.rollout.model_copy(update={"replicas": now_count})
            self.cfg = self.cfg.model_copy(update={"rollout": rollout})  # a global restart rebuilds this many
            if self._autoscaler is not None and (added or removed):
                self._autoscaler.changed(self.clock())
        seconds = round(time.monotonic() - start, 3)
        self._scale_event("done", before=before, count=now_count, seconds=seconds, added=added, removed=removed)
        return {"from": before, "to": now_count, "seconds": seconds, "added": added, "removed": removed}

    def _scale_event(self, event: str, **values: object) -> None:
        self.metrics.write("scale", {"event": event, "role": "rollout", **values})

    def _add_replica(self) -> str:
        import ray

        taken = set(self.replicas())
        index = next(i for i in range(MAX_REPLICAS) if replica_name(i) not in taken)
        name = replica_name(index)
        template = self.pipeline.services[replica_name(0)]
        cfg, prompt_queue, sample_queue, weights = template.args
        if isinstance(self.pipeline.weights, BroadcastWeightStore):
            weights = self.pipeline.weights.for_worker(index)
        spec = ServiceSpec(
            name,
            "rollout",
            template.cls,
            (cfg, prompt_queue, sample_queue, weights),
            dict(template.kwargs),
            resource=self.cfg.run.placement.get("rollout"),
        )
        target = int(self.pipeline.sample_queue.version)
        self._scale_event("join_started", replica=name, version=target)
        t0 = time.monotonic()
        try:
            spec.spawn(self.pipeline.namespace)
            held = self._wait_for_version(spec, target, t0 + JOIN_TIMEOUT_S)
            spec.start_loop(timeout=60.0)
        except Exception as exc:
            if spec.handle is not None:
                ray.kill(spec.handle, no_restart=True)  # it never leased a prompt: nothing to give back
            if not isinstance(exc, TimeoutError | ray.exceptions.RayError):
                raise  # not the join's failure (e.g. a global restart the loop's watching found): the loop handles it
            message = f"replica {name} failed to join ({type(exc).__name__}: {exc}); rolled back"
            self._scale_event("join_failed", replica=name, error=message, seconds=round(time.monotonic() - t0, 3))
            raise ScaleError(message) from exc
        self.pipeline.services[name] = spec
        self.health.admit(name)
        self._scale_event("joined", replica=name, pid=spec.pid, version=held, seconds=round(time.monotonic() - t0, 3))
        return name

    def _wait_for_version(self, spec: ServiceSpec, target: int, deadline: float) -> int:
        """Poll the new replica's held version until it reaches ``target``, keeping the loop's work going."""
        import ray

        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"it did not hold version {target} within {JOIN_TIMEOUT_S:.0f} s")
            ref = spec.handle.policy_version.remote()
            while True:  # the first answer waits for the process to import and build its model
                done, _ = ray.wait([ref], timeout=min(0.5, max(left, 0.01)))
                if done:
                    break
                self._between_steps()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"it was not built within {JOIN_TIMEOUT_S:.0f} s")
            held = int(ray.get(ref))
            if held >= target:
                return held
            self._between_steps()
            time.sleep(0.1)

    def _remove_replica(self) -> str:
        import ray

        name = self.replicas()[-1]
        spec = self.pipeline.services[name]
        if spec.host is not None or name == replica_name(0):
            raise ScaleError(f"{name} shares its process with other roles ({spec.host}): it is never removed")
        if self.health.busy(name):
            raise ScaleError(f"{name} is being restarted after a failure; ask again once it is back")
        self._scale_event("drain_started", replica=name)
        t0 = time.monotonic()
        ref = spec.handle.stop.remote(DRAIN_TIMEOUT_S)
        drained = False
        while True:
            done, _ = ray.wait([ref], timeout=0.5)
            if done:
                try:
                    drained = bool(ray.get(ref))
                except ray.exceptions.RayError:  # it died meanwhile: its leases expire and are redelivered
                    drained = False
                break
            if time.monotonic() - t0 > DRAIN_TIMEOUT_S + 30.0:
                break
            self._between_steps()
        del self.pipeline.services[name]  # before its last records: none is collected twice
        try:
            for record in ray.get(spec.handle.report.remote(), timeout=30):
                self._ingest(record)
        except ray.exceptions.RayError:
            pass  # a process already gone has nothing more to report
        ray.kill(spec.handle, no_restart=True)
        ray.get(self.pipeline.health.forget.remote(name), timeout=60)
        self.health.forget(name)
        self._scale_event("removed", replica=name, drained=drained, seconds=round(time.monotonic() - t0, 3))
        return name
