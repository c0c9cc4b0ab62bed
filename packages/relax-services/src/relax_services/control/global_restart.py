"""The controller's global restarts: which failure is one (a ``GlobalRestartNeeded``, or Ray reporting a queue,
store or monitor actor gone), tearing every service down and bringing the run back from its last checkpoint (again
when an actor's death interrupts the attempt), and, once ``health.max_global_restarts`` is spent, the message that
says what failed, what the run kept and how to continue it."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relax_services.config import RunConfig
from relax_services.control.checkpoint import CheckpointManager
from relax_services.data.feeder import PromptFeeder
from relax_services.faults.actor_watch import ActorLost, ActorWatch, actor_lost, why_dead
from relax_services.faults.health import GlobalRestartNeeded, HealthManager, ServiceGaveUpError

__all__ = ["GlobalRestarts"]


class GlobalRestarts:
    """Global restarts for :class:`~relax_services.control.controller.Controller`, which sets these attributes and calls
    :meth:`_global_restart` with :meth:`_restart_cause` of what its start or its loop raised."""

    cfg: RunConfig
    run_dir: Path
    step: int
    global_restarts: int  # global restarts so far in this run
    pipeline: Any  # the distributed or the colocated pipeline (absent until the first one is built)
    feeder: PromptFeeder  # absent until the first pipeline starts
    health: HealthManager
    watch: ActorWatch
    checkpoints: CheckpointManager
    _start_pipeline: Callable[[Path | None], None]  # the controller's: build and start the services

    def _restart_cause(self, exc: Exception) -> GlobalRestartNeeded:
        """``exc`` as the cause of a global restart: itself when it is one; for Ray reporting an actor gone (a call
        to a queue, a store or the monitor from this loop), which actor died and why. Anything else is re-raised."""
        if isinstance(exc, GlobalRestartNeeded):
            return exc
        if actor_lost(exc):
            return self.watch.find(exc) or GlobalRestartNeeded(f"an actor died: {why_dead(exc)}")
        raise exc

    def _global_restart(self, cause: GlobalRestartNeeded) -> None:
        """Tear every service down and bring the run back from its last checkpoint; an attempt that an actor's death
        interrupts is followed by another, each one counted against ``health.max_global_restarts``.

        Raises:
            ServiceGaveUpError: the allowance of global restarts is spent.
        """
        t0 = time.monotonic()
        reason = str(cause)
        interrupted: dict[str, object] = {}
        while True:
            if isinstance(cause, ActorLost):
                self.health.record_event("detected", cause.actor, reason=cause.why)
            self.global_restarts += 1
            self.health.record_event("global_restart", "run", reason=reason, step=self.step, **interrupted)
            if self.global_restarts > self.cfg.health.max_global_restarts:
                raise ServiceGaveUpError(
                    f"gave up after {self.global_restarts - 1} global restarts "
                    f"(health.max_global_restarts={self.cfg.health.max_global_restarts}); last failure: {reason}"
                )
            self.health.settle()  # an in-place restart still creating its actor must not outlive the old pipeline
            self._stop_parts()
            old = vars(self).get("pipeline")
            try:
                self._start_pipeline(self.checkpoints.latest())
            except Exception as exc:  # an actor died while the run came back: try again from the same checkpoint
                cause = self._restart_cause(exc)
                reason = f"global restart interrupted: {cause}"
                # Which services came up before the death was acted on (none when the pipeline was not even built).
                started = [] if vars(self).get("pipeline") is old else self._started_services()
                interrupted = {"services_started": started}
                continue
            self.health.record_event("recovered", "run", step=self.step, seconds=time.monotonic() - t0)
            return

    def _stop_parts(self) -> None:
        """Stop the feeder and the pipeline, as far as they exist (a first start can fail before either is built)."""
        built = vars(self)
        if "feeder" in built:
            self.feeder.stop()
        if "pipeline" in built:
            self.pipeline.stop()

    def _started_services(self) -> list[str]:
        """The services of the current pipeline whose start returned (after an interrupted start: the ones that
        came up before the death was acted on)."""
        return [name for name, spec in self.pipeline.services.items() if spec.pid is not None]

    def _gave_up_message(self, exc: ServiceGaveUpError) -> str:
        """What failed, what the run kept, and how to continue it."""
        latest = self.checkpoints.latest()
        if latest is None:
            kept = "no complete checkpoint: start the run again"
        else:
            kept = (
                f"kept: the checkpoint of step {self.checkpoints.load_controller(latest)['step']} ({latest}: weights, "
                "optimizer, queue snapshots and the prompt ledger); continue with: relax train "
                f"run.output_dir={self.run_dir.parent} run.name={self.run_dir.name} --resume"
            )
        return f"{exc}; {kept}"
