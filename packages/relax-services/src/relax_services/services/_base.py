"""What every service shares: a work loop on a thread the service owns, progress heartbeats sent from
inside that loop, metric records drained by the controller, and fault injection hooks."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypedDict, cast

if TYPE_CHECKING:
    from relax_queue import Batch, QueueReader

from relax_services.engines.progress import reporting_progress
from relax_services.faults.monitor import Beat, HealthMonitor  # re-exported: their home before they moved

__all__ = ["Beat", "HealthHandle", "HealthMonitor", "ServiceBase", "ServiceStatus"]


class ServiceStatus(TypedDict):
    """What :meth:`ServiceBase.status` reports."""

    name: str
    pid: int
    progress: int
    error: str | None


class _RemoteBeat(Protocol):
    def remote(self, name: str, progress: int, pid: int, error: str | None) -> object: ...


class HealthHandle(Protocol):
    """Where a service sends its heartbeats: a Ray actor handle of a :class:`HealthMonitor` (a beat is a
    fire-and-forget ``beat.remote(...)`` call)."""

    @property
    def beat(self) -> _RemoteBeat:
        """The monitor's ``beat`` method, called as ``beat.remote(name, progress, pid, error)``."""
        ...


class ServiceBase:
    """Base of the service actors: owns the work-loop thread and the shared control surface.

    Subclasses implement :meth:`step` (one bounded unit of work, e.g. one queue ``get`` with a timeout and what
    follows); the loop calls it until stopped and beats after each call.
    """

    beat_interval_s = 0.25
    model_stack: ClassVar[bool] = True
    """Whether the service runs a model (then its process is configured for torch; a service without one never
    imports torch)."""

    def __init__(self, name: str, health: HealthHandle | None) -> None:
        if self.model_stack:
            from relax_services.engines._threads import configure_process  # torch: services with a model only

            configure_process()
        self.name = name
        self._health = health
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._progress = 0
        self._error: str | None = None
        self._fault: str | None = None
        # Set by an injected ``break``; a rebuild runs ``__init__`` again only after checking it, so it stays set.
        self._broken = False
        self._records: list[dict[str, Any]] = []
        self._records_lock = threading.Lock()
        self._last_beat = 0.0
        self._reported_peak = 0

    # ------------------------------------------------------------------ control surface (actor methods)
    def start(self) -> int:
        """Start the work loop; returns the service's process id."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"{self.name}-loop", daemon=True)
            self._thread.start()
        return os.getpid()

    def stop(self, timeout: float = 10.0) -> bool:
        """Ask the loop to finish its current unit of work and exit; True when it did within ``timeout``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def rebuild(self, *args: object, **kwargs: object) -> int:
        """Build the service again in this process after its work loop raised, and start the new loop; returns the
        process id.

        What a new process would do, without importing the model stack again (most of a restart's time): the
        constructor runs again with ``args`` and ``kwargs``, the arguments the service was created with (a new
        engine, reader and state; the old loop's leases expire and their rows are redelivered, as after a kill).
        They are passed again because Ray builds an actor with ``__new__`` and ``__init__`` apart.

        Raises:
            RuntimeError: If the work loop is still running (a hang: only a new process ends it), or this process was
                left unable to rebuild it (an injected ``break``).
        """
        if self._broken:  # what a constructor failing in a damaged process looks like to the health manager
            raise RuntimeError(f"{self.name}: injected fault 'break': this process cannot rebuild the service")
        if self._thread is not None and self._error is not None:
            # The loop raised: it records the error, then returns; the status can be read in between.
            self._thread.join(timeout=5.0)
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError(f"{self.name}: the work loop is still running; it cannot be rebuilt in place")
        self.stop(timeout=5.0)  # the loop is out: releases what the service holds (a reward runner's threads)
        init = cast("Callable[..., None]", type(self).__init__)  # the subclass's own signature
        init(self, *args, **kwargs)
        return self.start()

    def pid(self) -> int:
        """The service's process id."""
        return os.getpid()

    def node_id(self) -> str:
        """Id of the Ray node this service runs on."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def status(self) -> ServiceStatus:
        """Name, process id, progress counter and loop error."""
        return {"name": self.name, "pid": os.getpid(), "progress": self._progress, "error": self._error}

    def report(self) -> list[dict[str, Any]]:
        """Metric records produced since the last call (the controller writes them to metrics.jsonl), with a
        ``device_memory`` record whenever this process's peak CUDA memory rose (:meth:`_device_peak`)."""
        self._device_peak()
        with self._records_lock:
            out, self._records = self._records, []
        return out

    def _device_peak(self) -> None:
        """Record ``device_memory`` (``peak_mib``: torch's peak allocated bytes on this process's current CUDA
        device, ``reserved_mib``: its allocator's peak reservation) when the peak rose since the last record. The
        peak is the process's, so services that share a host report the same figure. Nothing on a process that
        never used CUDA (torch is not even imported for that)."""
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_initialized():
            return
        peak = int(torch.cuda.max_memory_allocated())
        if peak > self._reported_peak:
            self._reported_peak = peak
            reserved = int(torch.cuda.max_memory_reserved())
            self.record("device_memory", peak_mib=round(peak / 2**20, 1), reserved_mib=round(reserved / 2**20, 1))

    def inject(self, kind: str) -> None:
        """Fault injection: ``"raise"`` makes the next loop iteration raise, ``"hang"`` blocks the loop forever,
        ``"break"`` raises as ``"raise"`` does and leaves this process unable to rebuild the service (its
        :meth:`rebuild` raises), so that only a new process brings it back."""
        if kind not in ("raise", "hang", "break"):
            raise ValueError(f"inject kind must be 'raise', 'hang' or 'break', got {kind!r}")
        self._broken = kind == "break"
        self._fault = "raise" if kind == "break" else kind

    # ------------------------------------------------------------------ for subclasses
    def step(self) -> None:
        """One bounded unit of work (subclasses implement it)."""
        raise NotImplementedError

    def ack(self, reader: QueueReader, batch: Batch) -> bool:
        """Ack ``batch``; False when its lease had already expired (the rows were redelivered and will be redone:
        every write here is idempotent by key, so the late work is harmless)."""
        from relax_queue import LeaseError

        try:
            reader.ack(batch)
        except LeaseError:
            self.record("late_ack", rows=len(batch))
            return False
        return True

    @contextlib.contextmanager
    def keep_leased(self, reader: QueueReader, batch: Batch, every_s: float = 5.0) -> Iterator[None]:
        """Renew ``batch``'s lease every ``every_s`` seconds while the body runs, from a thread this block owns
        (stopped and joined on exit). A rollout call can outlast the prompt queue's short lease (multi-turn episodes
        on a loaded CPU took 30-150 s against 15 s): without renewal its prompts were redelivered and generated again
        as duplicates, over and over, and the run stopped advancing."""
        from relax_queue import LeaseError

        done = threading.Event()

        def renew() -> None:
            while not done.wait(every_s):
                try:
                    reader.renew(batch)
                except LeaseError:
                    return  # expired already (a stall longer than the lease): the late ack records it

        thread = threading.Thread(target=renew, name=f"{self.name}-lease", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def catch_up(
        self, target: int, held: Callable[[], int], sync: Callable[[], None], reader: QueueReader, batch: Batch
    ) -> None:
        """Pull weights (``sync``) until the version ``held`` reaches ``target`` (the trainer's published version)
        or the service stops, renewing ``batch``'s lease so its rows stay with this service while it waits."""
        while True:
            sync()
            if held() >= target or self.stopping:
                return
            reader.renew(batch)
            # Waiting for the trainer is not a hang of this service (right after a restart the trainer may take
            # a while to republish): the wait counts as progress; a trainer that never publishes is caught as
            # the trainer's own hang.
            self._progress += 1
            self._beat()
            self._stop.wait(0.05)

    def record(self, kind: str, **values: object) -> None:
        """Queue a metric record ``{"kind", "service", "time", **values}`` for the controller."""
        with self._records_lock:
            self._records.append({"kind": kind, "service": self.name, "time": time.time(), **values})

    @property
    def stopping(self) -> bool:
        """Whether the loop was asked to stop."""
        return self._stop.is_set()

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._maybe_fault()
                with reporting_progress(self._tick):  # a long engine call ticks inside the step
                    self.step()
                self._tick()
        except Exception as exc:  # reported to the health manager, which restarts the service
            self._error = f"{type(exc).__name__}: {exc}"
            self.record("error", error=self._error, traceback=traceback.format_exc())
            self._beat(force=True)

    def _tick(self) -> None:
        self._progress += 1
        self._beat()

    def _maybe_fault(self) -> None:
        fault, self._fault = self._fault, None
        if fault == "raise":
            raise RuntimeError(f"injected fault in {self.name}")
        if fault == "hang":
            self._stop.wait()  # alive, but no progress: only the heartbeat timeout can tell

    def _beat(self, force: bool = False) -> None:
        now = time.monotonic()
        if self._health is None or (not force and now - self._last_beat < self.beat_interval_s):
            return
        self._last_beat = now
        self._health.beat.remote(self.name, self._progress, os.getpid(), self._error)
