"""Colocated mode (``run.mode=colocated``): every service of a run as a thread of one process.

The same service classes as the distributed mode (the same :func:`~relax_services.control.pipeline.service_plan`), over
the
in-process transports: :class:`relax_queue.TransferQueue` for the prompt and sample queues (same tasks, capacity,
τ admission and staleness check, leases, snapshots) and :class:`~relax_services.weights.InProcessWeightStore` for
the weights. The controller is the distributed one with its Ray calls replaced by direct calls, so checkpoints,
the prompt ledger, evaluation, stop conditions, in-place restarts of failed or hung services and global restarts
from the last checkpoint all behave the same. What it saves: no Ray start-up, one Python and torch import instead
of one per service, and no serialisation or actor hop per queue call or weight version (a published version is
one CPU snapshot shared by reference by every reader in the process).

What it cannot do: spread roles over processes, GPUs or nodes (``run.placement``, ``run.ray_address``), survive a
service killed at the process level (a ``kill`` fault would end the whole run), or run more than one model forward
at a time on CPU beyond what torch's threads overlap (the GIL is released inside torch kernels).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from relax_queue import TransferQueue
from relax_services._malloc import limit_arenas
from relax_services.config import RunConfig
from relax_services.config.threads import threads_of
from relax_services.control.checkpoint import load_queue_snapshots
from relax_services.control.controller import Controller
from relax_services.control.pipeline import Heldout, pipeline_family, queue_configs, service_plan
from relax_services.data.prompts import PromptBuilder
from relax_services.data.run_data import WarmupItem
from relax_services.engines.registry import check_engines
from relax_services.faults.health import GlobalRestartNeeded, HealthManager
from relax_services.faults.restart_counts import restarted_event
from relax_services.hosting.service_host import service_class
from relax_services.reporting.samples import write_eval_samples
from relax_services.services import EvalService, TrainerService
from relax_services.services._base import Beat, HealthMonitor, ServiceBase
from relax_services.weights import InProcessWeightStore

__all__ = [
    "ColocatedController",
    "LocalPipeline",
    "LocalService",
    "build_local_pipeline",
    "check_colocated",
]

COLOCATED_ARENAS = 2
"""glibc heaps of the colocated process, shared by its services' threads (a Ray actor's ``MALLOC_ARENA_MAX``)."""


def check_colocated(cfg: RunConfig) -> None:
    """Reject settings the colocated mode cannot honour.

    Raises:
        ValueError: ``run.ray_address`` or ``run.placement`` set, a ``kill`` fault (it would end the process), a
            ``break`` fault (no process to replace), or
            ``trainer.weight_sync=broadcast`` (the threads share one in-process weight store).
    """
    if cfg.trainer.weight_sync != "object_store":
        raise ValueError(
            f"trainer.weight_sync={cfg.trainer.weight_sync!r} needs run.mode=distributed: the colocated services "
            "share one in-process weight store"
        )
    if cfg.run.ray_address is not None:
        raise ValueError("run.mode=colocated runs in one process without Ray: unset run.ray_address")
    if cfg.run.placement:
        raise ValueError("run.mode=colocated places every role in this process: unset run.placement")
    kills = [i for i, f in enumerate(cfg.faults) if f.kind == "kill"]
    if kills:
        raise ValueError(f"faults[{kills[0]}].kind=kill would end the one colocated process; use raise or hang")
    # A colocated restart builds a new service object, never rebuilds the old one: a break would be a plain raise.
    breaks = [i for i, f in enumerate(cfg.faults) if f.kind == "break"]
    if breaks:
        raise ValueError(
            f"faults[{breaks[0]}].kind=break needs a process to replace (run.mode=distributed); use raise or hang"
        )


class _LocalBeat:
    """``beat.remote(...)`` as a direct, locked call (what a service expects of its health handle)."""

    def __init__(self, monitor: HealthMonitor, lock: threading.Lock) -> None:
        self._monitor = monitor
        self._lock = lock

    def remote(self, name: str, progress: int, pid: int, error: str | None) -> None:
        with self._lock:
            self._monitor.beat(name, progress, pid, error)


class LocalHealth:
    """A :class:`HealthMonitor` shared by the threads of one process (a :class:`HealthHandle` for the services)."""

    def __init__(self) -> None:
        self.monitor = HealthMonitor()
        self._lock = threading.Lock()
        self.beat = _LocalBeat(self.monitor, self._lock)

    def snapshot(self) -> dict[str, Beat]:
        """The latest heartbeat of every service, by name."""
        with self._lock:
            return self.monitor.snapshot()

    def forget(self, name: str) -> None:
        """Drops service ``name``'s heartbeats (it is being rebuilt; its age restarts at its next beat)."""
        with self._lock:
            self.monitor.forget(name)


@dataclass
class LocalService:
    """How to (re)create one service in this process: restarts build a fresh instance from the same arguments."""

    name: str
    role: str
    cls: type[ServiceBase] | str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    obj: Any = None
    pid: int | None = None
    restarts: int = 0

    def create(self) -> ServiceBase:
        """Build the service (its engines and models) and start its work-loop thread."""
        obj: ServiceBase = service_class(self.cls)(self.name, *self.args, **self.kwargs)
        self.pid = obj.start()
        self.obj = obj
        return obj


@dataclass
class LocalPipeline:
    """The colocated counterpart of :class:`~relax_services.control.pipeline.Pipeline` (what the controller drives)."""

    cfg: RunConfig
    prompt_queue: TransferQueue
    sample_queue: TransferQueue
    weights: InProcessWeightStore
    health: LocalHealth
    services: dict[str, LocalService]
    critic_weights: InProcessWeightStore | None = None
    namespace: str = "colocated"

    def start(self, watch: Callable[[], None] | None = None) -> None:
        """Build and start every service, one after the other (one process: nothing to overlap); ``watch`` is
        called before each (as :meth:`relax_services.control.pipeline.Pipeline.start` calls it while services start)."""
        for spec in self.services.values():
            if watch is not None:
                watch()
            spec.create()

    def actors(self) -> dict[str, Any]:
        """No actors: the queues, stores and monitor are objects of this process."""
        return {}

    def node_ids(self) -> dict[str, str]:
        """Service name → node: ``"local"`` for every service (they share this process)."""
        return {name: "local" for name in self.services}

    def stop(self, timeout: float = 15.0) -> None:
        """Stop every service loop (a loop still busy after ``timeout`` is a daemon thread: it dies with the
        process), then close the queues so a straggler's queue call ends."""
        for spec in self.services.values():
            if spec.obj is not None:
                spec.obj.stop(timeout)
        self.prompt_queue.close()
        self.sample_queue.close()

    def trainer(self) -> TrainerService:
        """The Trainer service object."""
        obj = self.services["trainer"].obj
        assert isinstance(obj, TrainerService)
        return obj


def build_local_pipeline(
    cfg: RunConfig, heldout: Heldout, restore: Path | None = None, *, to_prompt: PromptBuilder | None = None
) -> LocalPipeline:
    """The run's services (chosen per algorithm like the distributed builders) over in-process transports
    (``to_prompt``: the Rollout workers build the prompts of record rows, see :func:`~relax_services.control.pipeline.
    service_plan`)."""
    check_engines(cfg)
    limit_arenas(COLOCATED_ARENAS)  # before the services' threads start, as the actors' MALLOC_ARENA_MAX
    critic = pipeline_family(cfg.algorithm.advantage_estimator) == "ppo"
    prompts_cfg, samples_cfg = queue_configs(cfg)
    prompt_queue, sample_queue = TransferQueue(prompts_cfg), TransferQueue(samples_cfg)
    if restore is not None:  # leased-but-unacked rows of the snapshot are delivered again
        load_queue_snapshots(prompt_queue, sample_queue, restore)
    # Only the newest; readers compute with it in place.
    weights = InProcessWeightStore(keep=1, recycle=cfg.run.reuse_weight_buffers)
    critic_weights = InProcessWeightStore(keep=1, recycle=cfg.run.reuse_weight_buffers) if critic else None
    health = LocalHealth()
    services = {
        name: LocalService(name, role, cls, args, {**kwargs, "health": health})
        for name, role, cls, args, kwargs in service_plan(
            cfg, heldout, restore, prompt_queue, sample_queue, weights, critic_weights, to_prompt
        )
    }
    return LocalPipeline(cfg, prompt_queue, sample_queue, weights, health, services, critic_weights)


class LocalHealthManager(HealthManager):
    """:class:`HealthManager` for threads: a loop that raised or stopped making progress is rebuilt in place;
    the trainer (or a service past its restarts) brings a global restart from the last checkpoint."""

    def collect_reports(self, pipeline: LocalPipeline) -> dict[str, list[dict[str, object]]]:  # type: ignore[override]
        """Each service's records since the last call (its ``report()``), by service name."""
        return {name: spec.obj.report() for name, spec in pipeline.services.items() if spec.obj is not None}

    def check(self, pipeline: LocalPipeline) -> None:  # type: ignore[override]
        """A raised or hung loop (judged like the distributed manager: monotonic ages, grace after a start) is
        rebuilt in place, synchronously (the services share this process)."""
        for name, reason in self.judge(pipeline.health.snapshot(), pipeline.services, time.monotonic()).items():
            self._restart(pipeline, pipeline.services[name], reason)

    def _restart(self, pipeline: LocalPipeline, spec: LocalService, reason: str) -> None:  # type: ignore[override]
        self.record_event("detected", spec.name, reason=reason)
        if spec.role == "trainer":  # its state lives in the last checkpoint: restart the whole run from there
            raise GlobalRestartNeeded(f"trainer failed: {reason}")
        if spec.restarts >= self.cfg.max_restarts:
            self.record_event("gave_up", spec.name, restarts=spec.restarts)
            raise GlobalRestartNeeded(f"service {spec.name} failed {spec.restarts + 1} times; last: {reason}")
        t0 = time.monotonic()
        if spec.obj is not None:
            spec.obj.stop(timeout=5.0)  # a hung loop waits on its stop event; a raised one has ended already
        time.sleep(self.cfg.restart_backoff_s * (2**spec.restarts))
        pipeline.health.forget(spec.name)
        spec.restarts += 1
        spec.create()
        self._started[spec.name] = time.monotonic()
        # A new service object in the one process: "same" process, as a distributed rebuild in place is.
        self.record_event(
            "restarted", spec.name, **restarted_event(spec.restarts, spec.pid, time.monotonic() - t0, "same", None)
        )


class ColocatedController(Controller):
    """:class:`Controller` with the services as threads of this process: Ray calls become direct calls."""

    pipeline: Any
    pipeline_builder = staticmethod(build_local_pipeline)  # type: ignore[assignment]  # duck-typed Pipeline
    prompts_here = True  # this process imports the model stack anyway: prompts are built here, once

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        resume: bool = False,
        resume_changes: dict[str, tuple[object, object]] | None = None,
        started_at: float | None = None,
    ) -> None:
        check_colocated(cfg)
        super().__init__(cfg, run_dir, resume, resume_changes, started_at)
        # Each service's engine pins run.threads in its own thread at every call (the launch divided the cores
        # among them); the process starts at the same count.
        torch.set_num_threads(threads_of(cfg))

    def _start_pipeline(self, restore: Path | None) -> None:
        if not isinstance(self.health, LocalHealthManager):  # the base run() builds the Ray-side manager
            self.health = LocalHealthManager(self.cfg.health, self.metrics)
        super()._start_pipeline(restore)

    def _checkpoint(self, hold: bool = False) -> Path:
        """The distributed controller's consistent checkpoint, by direct calls to the trainer thread."""
        trainer = self.pipeline.trainer()
        error = trainer.status()["error"]
        if error is not None:  # its loop has ended: a pause would only wait out its timeout
            raise GlobalRestartNeeded(f"trainer unavailable for a checkpoint: {error}")
        try:
            version = trainer.pause(timeout=30 + 2 * self.cfg.health.heartbeat_timeout_s)
        except TimeoutError as exc:
            raise GlobalRestartNeeded(f"trainer unavailable for a checkpoint: {exc}") from exc
        return self._write_checkpoint(version, trainer.save_engine, None if hold else trainer.resume)

    def _run_warmup(self, cfg: RunConfig, items: list[WarmupItem], out: Path) -> dict[str, object]:
        """The format warm-up in this process (the distributed mode gives it a process of its own)."""
        from relax_services.control.warmup import format_warmup

        return format_warmup(cfg, items, self.data.to_prompt, str(out), cfg.trainer.seed)

    def _service_call(self, service: str, method: str, *args: object) -> object:
        """``method(*args)`` of service ``service``, by a direct call (the services are objects of this process)."""
        result: object = getattr(self.pipeline.services[service].obj, method)(*args)
        return result

    def _final_eval(self) -> tuple[dict[str, float], int | None]:
        evaluator = self.pipeline.services["eval"].obj
        assert isinstance(evaluator, EvalService)
        version, rewards, samples = evaluator.evaluate_latest()
        write_eval_samples(self.run_dir, int(version), self.step, samples, final=True)
        self.metrics.write("eval", {"version": version, "reward": rewards, "chance": self.data.chance, "final": True})
        return dict(rewards), int(version)

    def _inject(self, service: str, kind: str) -> None:
        self.pipeline.services[service].obj.inject(kind)  # check_colocated rejected 'kill'
