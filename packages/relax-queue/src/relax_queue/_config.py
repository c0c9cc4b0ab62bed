"""Typed configuration of a queue: tasks, capacity, staleness policy and leases.

A queue is assembled from injected parts, each replaceable: a :class:`Capacity` (storage bounds),
a staleness policy (anything satisfying :class:`StalenessPolicy`; :class:`BoundedStaleness` is the
AReaL-style default) and the list of tasks (consumer groups) that must consume every row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from relax_queue._errors import ConfigError

__all__ = [
    "ON_STALE_ACTIONS",
    "BoundedStaleness",
    "Capacity",
    "OnStale",
    "QueueConfig",
    "StalenessPolicy",
    "TaskSpec",
]

OnStale = Literal["drop", "requeue", "flag"]
ON_STALE_ACTIONS: tuple[str, ...] = ("drop", "requeue", "flag")


@dataclass(frozen=True)
class TaskSpec:
    """A consumer group. Every row is delivered to every task; readers of one task share rows.

    Attributes:
        name: task id, e.g. ``"reward"``, ``"reference"``, ``"trainer"``.
        check_staleness: apply the staleness policy's consumption-time check to rows delivered to
            this task (the trainer); other tasks (reward, reference) receive rows regardless of age.
    """

    name: str
    check_staleness: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"TaskSpec.name must be a non-empty string, got {self.name!r}")


@dataclass(frozen=True)
class Capacity:
    """Storage bounds. A put of a new row blocks (with timeout) while either bound is reached.

    Attributes:
        max_rows: most rows held at once; ``None`` for no bound.
        max_bytes: most payload bytes held at once (estimated per field: ``nbytes`` of arrays and
            tensors, ``len`` of bytes/str, a recursive estimate of containers); ``None`` for no bound.
            Fields added to rows already stored are counted but never blocked (blocking them could
            deadlock a pipeline whose consumers wait for those fields), so the byte depth can exceed
            ``max_bytes`` by field additions; new rows then wait until it is back under. A row that would
            itself exceed ``max_bytes``, put whole or by an addition, is a ``RowTooLargeError`` naming its
            largest field (the addition is refused whole: the row stays as it was).
    """

    max_rows: int | None = 100_000
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_rows", "max_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ConfigError(f"Capacity.{name} must be a positive int or None, got {value!r}")


@runtime_checkable
class StalenessPolicy(Protocol):
    """Decides admission (pacing producers) and the consumption-time staleness check."""

    @property
    def on_stale(self) -> OnStale:
        """What happens to a stale row at consumption: ``drop``, ``requeue`` or ``flag``."""
        ...

    def admission_capacity(self, version: int, accepted: int, running: int) -> int | None:
        """How many more samples may start now; ``None`` means unlimited."""
        ...

    def is_stale(self, version: int, v_min: int) -> bool:
        """Whether a row whose oldest token came from ``v_min`` is too old to consume at ``version``."""
        ...


@dataclass(frozen=True)
class BoundedStaleness:
    """Staleness bound τ with AReaL-style admission control.

    A sample consumed by the update that produces version V+1 has staleness ``V - v_min``; no
    delivered row to a staleness-checked task exceeds ``tau``. Admission lets producers start
    ``(tau + V + 1) * batch_size - (accepted + running)`` more samples, so that in normal operation
    nothing is generated only to be thrown away.

    Attributes:
        tau: largest allowed staleness; ``None`` is τ = ∞ (no check, unlimited admission).
        on_stale: action for a stale row at consumption; always counted in metrics.
        batch_size: B, the number of rows (samples) one trainer update consumes.
    """

    tau: int | None = None
    on_stale: OnStale = "drop"
    batch_size: int = 1

    def __post_init__(self) -> None:
        if self.tau is not None and (not isinstance(self.tau, int) or isinstance(self.tau, bool) or self.tau < 0):
            raise ConfigError(f"BoundedStaleness.tau must be an int >= 0 or None (infinity), got {self.tau!r}")
        if self.on_stale not in ON_STALE_ACTIONS:
            raise ConfigError(f"BoundedStaleness.on_stale must be one of {ON_STALE_ACTIONS}, got {self.on_stale!r}")
        if not isinstance(self.batch_size, int) or isinstance(self.batch_size, bool) or self.batch_size <= 0:
            raise ConfigError(f"BoundedStaleness.batch_size must be a positive int, got {self.batch_size!r}")

    def admission_capacity(self, version: int, accepted: int, running: int) -> int | None:
        """``(tau + V + 1) * B - (accepted + running)``, or ``None`` (unlimited) when τ = ∞."""
        if self.tau is None:
            return None
        return (self.tau + version + 1) * self.batch_size - (accepted + running)

    def is_stale(self, version: int, v_min: int) -> bool:
        """``version - v_min > tau`` (never stale when τ = ∞)."""
        return self.tau is not None and version - v_min > self.tau


@dataclass(frozen=True)
class QueueConfig:
    """Everything needed to build a queue (plain, picklable: it also configures the Ray actor).

    Attributes:
        tasks: consumer groups that must each consume (ack) a row before it is freed. Strings are
            accepted as shorthand for ``TaskSpec(name)``.
        capacity: row and byte bounds.
        staleness: the staleness policy (admission + consumption check).
        lease_timeout_s: seconds a delivered batch stays leased before it is redelivered.
        remember_retired: how many freed/dropped keys are at least remembered (up to twice as many: they
            are forgotten a generation of this many at a time) so that a late duplicate put
            of a consumed key is ignored instead of delivering the row again.
        latency_window: how many recent put/get latencies the metrics percentiles are computed over.
    """

    tasks: tuple[TaskSpec, ...] = (TaskSpec("default"),)
    capacity: Capacity = field(default_factory=Capacity)
    staleness: StalenessPolicy = field(default_factory=BoundedStaleness)
    lease_timeout_s: float = 60.0
    remember_retired: int = 1_000_000
    latency_window: int = 10_000

    def __post_init__(self) -> None:
        raw = self.tasks if isinstance(self.tasks, list | tuple) else None
        if raw is None or not raw:
            raise ConfigError(f"QueueConfig.tasks must be a non-empty list of TaskSpec or str, got {self.tasks!r}")
        specs = tuple(TaskSpec(t) if isinstance(t, str) else t for t in raw)
        for spec in specs:
            if not isinstance(spec, TaskSpec):
                raise ConfigError(f"QueueConfig.tasks entries must be TaskSpec or str, got {spec!r}")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ConfigError(f"QueueConfig.tasks has duplicate task names: {names}")
        object.__setattr__(self, "tasks", specs)
        if not isinstance(self.capacity, Capacity):
            raise ConfigError(f"QueueConfig.capacity must be a Capacity, got {self.capacity!r}")
        if not isinstance(self.staleness, StalenessPolicy):
            raise ConfigError(
                f"QueueConfig.staleness must implement StalenessPolicy (e.g. BoundedStaleness), got {self.staleness!r}"
            )
        if not isinstance(self.lease_timeout_s, int | float) or self.lease_timeout_s <= 0:
            raise ConfigError(f"QueueConfig.lease_timeout_s must be a positive number, got {self.lease_timeout_s!r}")
        for name in ("remember_retired", "latency_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"QueueConfig.{name} must be an int >= 0, got {value!r}")

    @property
    def task_names(self) -> tuple[str, ...]:
        """Names of the registered tasks, in order."""
        return tuple(s.name for s in self.tasks)
