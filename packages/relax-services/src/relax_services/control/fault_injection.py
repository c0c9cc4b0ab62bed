"""The controller's fault injection (tests and ``relax chaos``): the run config's ``faults``, each delivered once
when the trainer reaches its step, to a service (SIGKILL, or a raise or hang in its loop) or to one of the
pipeline's other actors (SIGKILL of a queue, store or monitor actor, mid-run or inside the next global restart).
Each injection is a health event that records the fault's index, so a ``--resume`` does not inject it again."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from relax_services.config import ACTOR_TARGETS, FaultSpec, RunConfig
from relax_services.faults.actor_watch import ActorWatch
from relax_services.faults.health import HealthManager
from relax_services.hosting.ray_init import wait_gone
from relax_services.reporting.metrics import read_metrics

__all__ = ["FaultInjector"]


class FaultInjector:
    """Fault injection for :class:`~relax_services.control.controller.Controller`, which sets these attributes and calls
    :meth:`_inject_faults` from its loop; the colocated controller overrides :meth:`_inject` only."""

    cfg: RunConfig
    run_dir: Path
    step: int
    pipeline: Any  # the distributed or the colocated pipeline: services by key, their actors, the sample queue
    health: HealthManager
    watch: ActorWatch
    _faults_pending: list[tuple[int, FaultSpec]]  # (index in cfg.faults, fault), not injected yet
    _restart_faults: list[tuple[int, FaultSpec]]  # armed ``during_restart`` faults: the next global restart

    def _drop_fired_faults(self) -> None:
        """On ``--resume``: the faults the earlier run injected (its ``injected`` health events in metrics.jsonl
        carry their index in ``faults``) are not injected again; the others still are, at their steps."""
        fired = {e.get("fault_index") for e in read_metrics(self.run_dir / "metrics.jsonl", "health")}
        self._faults_pending = [(i, f) for i, f in self._faults_pending if i not in fired]

    def _inject_faults(self) -> None:
        for index, fault in list(self._faults_pending):
            if self.step < fault.at_step:
                continue
            if fault.min_trainer_backlog and self._trainer_backlog() < fault.min_trainer_backlog:
                continue
            self._faults_pending.remove((index, fault))
            if fault.during_restart:
                self._restart_faults.append((index, fault))  # armed: lands in the next global restart
                continue
            if fault.service in ACTOR_TARGETS:
                self._kill_actor(fault, index)
                continue
            targets = [key for key, s in self.pipeline.services.items() if s.role == fault.service]
            if fault.replica is not None:  # one Rollout replica by its index (it may have been scaled in)
                targets = [key for key in targets if key == f"rollout-{fault.replica}"]
            if not targets:
                which = fault.service if fault.replica is None else f"rollout-{fault.replica}"
                raise ValueError(f"faults: no {which!r} service in this pipeline")
            self.health.record_event(
                "injected", self.pipeline.services[targets[0]].name, fault=fault.kind, step=self.step, fault_index=index
            )
            self._inject(targets[0], fault.kind)

    def _kill_actor(self, fault: FaultSpec, index: int | None = None) -> None:
        """SIGKILL the process of the queue, store or monitor actor ``fault.service`` (as Ray's memory monitor
        would end it), and wait until it is gone. ``index``: the fault's place in ``faults`` (recorded)."""
        if fault.service not in self.watch.actors:
            raise ValueError(f"faults: no {fault.service!r} actor in this pipeline")
        pid = self.watch.pid(fault.service)
        extra: dict[str, object] = {"during_restart": True} if fault.during_restart else {}
        if index is not None:
            extra["fault_index"] = index
        self.health.record_event("injected", fault.service, fault=fault.kind, step=self.step, pid=pid, **extra)
        self.watch.killed(fault.service)  # a process several actors share is reported under the one killed
        os.kill(pid, signal.SIGKILL)
        wait_gone(pid, timeout_s=30.0)  # SIGKILL ends it within moments: the fault is in place

    def _inject(self, service: str, kind: str) -> None:
        """Deliver one fault to the pipeline's service ``service``: ``kill`` as SIGKILL of its process, any other
        kind through its actor."""
        spec = self.pipeline.services[service]
        if kind == "kill":
            os.kill(int(spec.pid or 0), signal.SIGKILL)
        else:
            spec.handle.inject.remote(kind)

    def _trainer_backlog(self) -> int:
        """Sample rows complete for the trainer (every field it reads present) that it has not taken yet."""
        from relax_services.services import trainer_fields

        return int(self.pipeline.sample_queue.ready("trainer", trainer_fields(self.cfg)))
