"""The steps the queue's faces share: put progress (resumable after a capacity wait), the thread wait, get
attempts, the errors of a full or closed queue, and the argument checks every transport makes first."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from relax_queue._batchers import Batcher, FixedSizeBatcher
from relax_queue._columnar import ColumnInput, put_columns, try_get_columns
from relax_queue._core import FULL, QueueCore
from relax_queue._errors import (
    ArgumentError,
    FieldTypeError,
    GroupDeadlockError,
    QueueClosedError,
    QueueFullError,
    QueueTimeoutError,
)
from relax_queue._replica import ReplicaCoordinator, ReplicaSet
from relax_queue._settle import check_lease_s
from relax_queue._types import Batch, ColumnBatch, Key, RowInput

__all__ = [
    "PutColumns",
    "PutMany",
    "PutOne",
    "attempt_once",
    "batch_lease_id",
    "check_batch_size",
    "check_get_arguments",
    "check_open",
    "deadlock_hint",
    "full_error",
    "full_or_deadlock",
    "get_attempt",
    "get_columns_attempt",
    "normalise_fields",
    "timed_get",
    "wait_for",
]

T = TypeVar("T")


def batch_lease_id(batch: Batch | ColumnBatch | int) -> int:
    """The lease id of a batch, or the id itself."""
    return batch if isinstance(batch, int) else batch.lease_id


def normalise_fields(task: str, fields: Iterable[str] | None) -> tuple[str, ...] | None:
    """A reader's field names as a tuple (``None`` stays ``None``), each checked to be a str."""
    if fields is None:
        return None
    if isinstance(fields, str):
        raise FieldTypeError(f"reader of task {task!r}: fields must be a list of names, got the string {fields!r}")
    names = tuple(fields)
    for name in names:
        if not isinstance(name, str):
            raise FieldTypeError(f"reader of task {task!r}: field names must be str, got {name!r}")
    return names


class PutMany:
    """Progress of a ``put_many``: resumable after waiting for capacity (shared by sync/async)."""

    def __init__(self, core: QueueCore, rows: Sequence[RowInput], admitted: bool) -> None:
        self.core, self.rows, self.admitted, self.done = core, rows, admitted, 0
        self.inserted: list[Key] = []

    def __call__(self, now: float) -> bool | None:
        self.done = self.core.put_rows(self.rows, self.done, self.admitted, self.inserted)
        if self.done < len(self.rows):
            full_or_deadlock(self.core, self.inserted, len(self.rows))
            return None
        self.core.notify()
        return True

    def full_error(self, timeout: float | None) -> QueueFullError:
        return full_error(self.core, timeout, self.inserted, len(self.rows))


class PutColumns:
    """Progress of a ``put_columns``, like :class:`PutMany` (shared by sync/async)."""

    def __init__(self, core: QueueCore, columns: ColumnInput, admitted: bool) -> None:
        self.core, self.columns, self.admitted, self.done = core, columns, admitted, 0
        self.inserted: list[Key] = []

    def __call__(self, now: float) -> bool | None:
        self.done = put_columns(self.core, self.columns, self.done, self.admitted, self.inserted)
        if self.done < len(self.columns):
            full_or_deadlock(self.core, self.inserted, len(self.columns))
            return None
        self.core.notify()
        return True

    def full_error(self, timeout: float | None) -> QueueFullError:
        return full_error(self.core, timeout, self.inserted, len(self.columns))


class PutOne:
    """A single ``put``, like :class:`PutMany` of one row without building a :class:`RowInput`."""

    def __init__(
        self,
        core: QueueCore,
        key: Key,
        fields: Mapping[str, Any],
        versions: tuple[int, int] | int | None,
        group_id: Hashable | None,
        group_size: int | None,
        tags: Mapping[str, int | float | str] | None,
        admitted: bool,
    ) -> None:
        self.core = core
        self.row = (key, fields, versions, group_id, group_size, tags, admitted)

    def __call__(self, now: float) -> bool | None:
        if self.core.put_row(*self.row) is FULL:
            full_or_deadlock(self.core, [], 1)
            return None
        self.core.notify()
        return True

    def full_error(self, timeout: float | None) -> QueueFullError:
        return full_error(self.core, timeout, [], 1)


def check_open(core: QueueCore, action: str) -> None:
    """Raise :class:`QueueClosedError` for ``action`` on a closed queue (caller holds the lock)."""
    if core.closed:
        raise QueueClosedError(f"cannot {action}: the queue is closed")


def full_or_deadlock(core: QueueCore, inserted: list[Key], total: int) -> None:
    """Raise :class:`GroupDeadlockError` when waiting for capacity can never help (else the put waits)."""
    reason = core.group_deadlock()
    if reason is not None:
        raise GroupDeadlockError(f"{reason}; {len(inserted)} of {total} rows were stored", inserted=inserted)


def deadlock_hint(core: QueueCore) -> str:
    """``; group deadlock: ...`` when a full queue holds only incomplete groups, else ``""`` (caller holds the lock)."""
    cap = core.config.capacity
    full = (cap.max_rows is not None and core.row_count() >= cap.max_rows) or cap.max_bytes is not None
    reason = core.group_deadlock() if full else None
    return "" if reason is None else f"; {reason}"


def full_error(core: QueueCore, timeout: float | None, inserted: list[Key], total: int) -> QueueFullError:
    """The error of a put that waited ``timeout`` seconds for capacity in vain."""
    cap = core.config.capacity
    return QueueFullError(
        f"queue full for {timeout} s (rows {core.row_count()}/{cap.max_rows}, "
        f"bytes {core.nbytes}/{cap.max_bytes}); {len(inserted)} of {total} rows were stored",
        inserted=inserted,
    )


def check_batch_size(task: str, n: Any) -> None:
    """``n`` of a get: ``None`` (the batcher's default) or an int >= 1."""
    if n is not None and (type(n) is not int or n < 1):
        raise ArgumentError(f"get for task {task!r}: n must be None (the batcher's default) or an int >= 1, got {n!r}")


def check_get_arguments(task: str, n: Any, lease_s: Any) -> None:
    """A get's ``n`` and ``lease_s``, checked before anything else the call does (an ``ack=`` it carries, a Ray
    round trip), so a malformed get changes nothing on any transport.

    Raises:
        ArgumentError: either is out of range.
    """
    check_batch_size(task, n)
    check_lease_s(task, lease_s)


def attempt_once(core: QueueCore, attempt: Callable[[float], T | None]) -> T | None:
    """Run ``attempt`` once under the lock: the usual call succeeds at once and needs none of
    :func:`wait_for`'s machinery."""
    with core.lock:
        if core.closed:
            raise QueueClosedError("the queue is closed")
        return attempt(time.monotonic())


def wait_for(
    core: QueueCore, attempt: Callable[[float], T | None], timeout: float | None, on_timeout: Callable[[], Exception]
) -> T:
    """Run ``attempt`` under the lock until it returns a value, waking on changes and lease deadlines (threads)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with core.lock:
        while True:
            if core.closed:
                raise QueueClosedError("the queue is closed")
            now = time.monotonic()
            result = attempt(now)
            if result is not None:
                return result
            wait = None if deadline is None else deadline - now
            if wait is not None and wait <= 0:
                raise on_timeout()
            lease_deadline = core.next_deadline()
            if lease_deadline is not None:
                wait = max(lease_deadline - now, 0.0) + 1e-4 if wait is None else min(wait, lease_deadline - now + 1e-4)
            core.waiting += 1
            try:
                core.cond.wait(wait)
            finally:
                core.waiting -= 1


def timed_get(
    core: QueueCore,
    attempt: Callable[[float], T | None],
    task: str,
    fields: tuple[str, ...] | None,
    n: int | None,
    timeout: float | None,
) -> T:
    """Wait (threads) for ``attempt`` to deliver a batch (rows or columns) and record the get latency."""
    start = time.perf_counter()
    batch = attempt_once(core, attempt)
    if batch is None:
        batch = wait_for(
            core,
            attempt,
            timeout,
            lambda: QueueTimeoutError(
                f"task {task!r}: no batch ready within {timeout} s (fields={fields}, n={n})" + deadlock_hint(core)
            ),
        )
    core.counters.get_latency_s.append(time.perf_counter() - start)
    return batch


def get_attempt(
    core: QueueCore,
    replicas: ReplicaCoordinator,
    task: str,
    fields: tuple[str, ...] | None,
    n: int | None,
    batcher: Batcher | None,
    replica: ReplicaSet | None,
    lease_s: float | None = None,
) -> Callable[[float], Batch | None]:
    """A non-blocking get of rows (caller holds the lock), checked now and retried by the waits.

    Args:
        lease_s: seconds the lease lasts from delivery (``None``: the queue's ``lease_timeout_s``).
    """
    check_get_arguments(task, n, lease_s)
    chosen = batcher or FixedSizeBatcher()

    def attempt(now: float) -> Batch | None:
        if replica is None:
            return core.try_get(task, fields, n, chosen, now)
        return replicas.try_get(core, task, fields, n, chosen, now, replica)

    return attempt if lease_s is None else _leased_for(core, attempt, lease_s)


def get_columns_attempt(
    core: QueueCore,
    replicas: ReplicaCoordinator,
    task: str,
    fields: tuple[str, ...] | None,
    n: int | None,
    batcher: Batcher | None,
    replica: ReplicaSet | None,
    lease_s: float | None = None,
) -> Callable[[float], ColumnBatch | None]:
    """:func:`get_attempt` delivering columns."""
    check_get_arguments(task, n, lease_s)
    chosen = batcher or FixedSizeBatcher()

    def attempt(now: float) -> ColumnBatch | None:
        if replica is None:
            return try_get_columns(core, task, fields, n, chosen, now)
        return replicas.try_get_columns(core, task, fields, n, chosen, now, replica)

    return attempt if lease_s is None else _leased_for(core, attempt, lease_s)


B = TypeVar("B", Batch, ColumnBatch)


def _leased_for(core: QueueCore, attempt: Callable[[float], B | None], lease_s: float) -> Callable[[float], B | None]:
    """``attempt`` whose lease lasts ``lease_s`` seconds from delivery: set in the same step under the lock as the
    lease itself, so no caller ever sees the batch leased for the queue's default length."""

    def leased(now: float) -> B | None:
        batch = attempt(now)
        if batch is None:
            return None
        # A replica set's later ranks get the batch its first rank leased; the lease may have ended since.
        if batch.lease_id in core.leases:
            core.renew(batch.lease_id, now, lease_s)
        return dataclasses.replace(batch, lease_timeout_s=lease_s)

    return leased
