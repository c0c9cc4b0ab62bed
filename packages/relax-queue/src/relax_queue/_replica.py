"""Identical batches for every rank of a model-parallel replica set.

The first rank to ask for step ``s`` of replica set ``name`` leases a batch; every other rank
asking for its step ``s`` receives that same batch. The lease is acked once every rank acked it
(a nack or an expiry by anyone redelivers the rows to later steps).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from relax_queue._batchers import Batcher
from relax_queue._columnar import try_get_columns
from relax_queue._core import QueueCore
from relax_queue._errors import ConfigError
from relax_queue._types import Batch, ColumnBatch

__all__ = ["ReplicaCoordinator", "ReplicaSet"]


@dataclass(frozen=True)
class ReplicaSet:
    """Identifies one rank of a replica set whose ranks must all see the same batches.

    Attributes:
        name: replica set id, shared by its ranks (e.g. ``"trainer-dp0"``).
        rank: this reader's rank, ``0 <= rank < world_size``.
        world_size: number of ranks in the set.
    """

    name: str
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size <= 0:
            raise ConfigError(f"ReplicaSet.world_size must be a positive int, got {self.world_size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"ReplicaSet.rank must be in [0, {self.world_size}), got {self.rank!r}")


T = TypeVar("T", Batch, ColumnBatch)


def _as_batch(batch: Batch | ColumnBatch) -> Batch:
    return batch if isinstance(batch, Batch) else batch.to_batch()


def _as_columns(batch: Batch | ColumnBatch) -> ColumnBatch:
    return batch if isinstance(batch, ColumnBatch) else ColumnBatch.from_batch(batch)


@dataclass
class _Step:
    batch: Batch | ColumnBatch  # as the first rank asked for it; others get it in their own form
    fetched: set[int] = field(default_factory=set)
    acks: set[int] = field(default_factory=set)
    settled: bool = False


@dataclass
class _SetState:
    world_size: int
    next_step: list[int]
    steps: dict[int, _Step] = field(default_factory=dict)


class ReplicaCoordinator:
    """Replica-set bookkeeping of one queue (caller holds the queue lock)."""

    def __init__(self) -> None:
        self._sets: dict[tuple[str, str], _SetState] = {}
        self._by_lease: dict[int, tuple[_SetState, int]] = {}

    def try_get(
        self,
        core: QueueCore,
        task: str,
        fields: tuple[str, ...] | None,
        n: int | None,
        batcher: Batcher,
        now: float,
        replica: ReplicaSet,
    ) -> Batch | None:
        """This rank's next batch: the one its peers got for the same step, or a new lease."""
        return self._step(core, task, replica, now, lambda: core.try_get(task, fields, n, batcher, now), _as_batch)

    def try_get_columns(
        self,
        core: QueueCore,
        task: str,
        fields: tuple[str, ...] | None,
        n: int | None,
        batcher: Batcher,
        now: float,
        replica: ReplicaSet,
    ) -> ColumnBatch | None:
        """:meth:`try_get` delivering columns."""
        lease = lambda: try_get_columns(core, task, fields, n, batcher, now)  # noqa: E731
        return self._step(core, task, replica, now, lease, _as_columns)

    def _step(
        self,
        core: QueueCore,
        task: str,
        replica: ReplicaSet,
        now: float,
        lease: Callable[[], Batch | ColumnBatch | None],
        convert: Callable[[Batch | ColumnBatch], T],
    ) -> T | None:
        state = self._sets.get((task, replica.name))
        if state is None:
            state = self._sets[(task, replica.name)] = _SetState(replica.world_size, [0] * replica.world_size)
        elif state.world_size != replica.world_size:
            raise ConfigError(
                f"replica set {replica.name!r} of task {task!r} has world_size={state.world_size}, "
                f"a reader says {replica.world_size}"
            )
        step_no = state.next_step[replica.rank]
        step = state.steps.get(step_no)
        if step is None:
            batch = lease()
            if batch is None:
                return None
            step = state.steps[step_no] = _Step(batch)
            self._by_lease[batch.lease_id] = (state, step_no)
            core.leases[batch.lease_id].on_settle = lambda: self._settled(batch.lease_id)
        else:
            core.expire(now)
        batch = convert(step.batch)  # before the step counts as fetched: a failed conversion can be retried
        step.fetched.add(replica.rank)
        state.next_step[replica.rank] += 1
        self._cleanup(state, step_no)
        return batch

    def ack(self, lease_id: int, rank: int) -> bool:
        """Record ``rank``'s ack; ``True`` when every rank acked and the lease must be acked."""
        entry = self._by_lease.get(lease_id)
        if entry is None:
            return True
        state, step_no = entry
        step = state.steps[step_no]
        step.acks.add(rank)
        return len(step.acks) == state.world_size

    def _settled(self, lease_id: int) -> None:
        state, step_no = self._by_lease.pop(lease_id)
        state.steps[step_no].settled = True
        self._cleanup(state, step_no)

    def _cleanup(self, state: _SetState, step_no: int) -> None:
        step = state.steps.get(step_no)
        if step is not None and step.settled and len(step.fetched) == state.world_size:
            del state.steps[step_no]

    def reset(self) -> None:
        """Forget every replica set (after a restore: the leases are gone)."""
        self._sets.clear()
        self._by_lease.clear()
