"""``AsyncTransferQueue``: the asyncio face over the same core as ``TransferQueue``.

Blocking operations never block the event loop: they try under the lock, then await a wake-up
that the core sends (thread-safely) on every state change, or the next lease deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from relax_queue._batchers import Batcher, FixedSizeBatcher
from relax_queue._columnar import ColumnInput
from relax_queue._errors import QueueClosedError, QueueTimeoutError
from relax_queue._progress import PutColumns, PutMany, PutOne, check_get_arguments, normalise_fields
from relax_queue._queue import TransferQueue
from relax_queue._reader import get_kwargs
from relax_queue._replica import ReplicaSet
from relax_queue._types import Batch, ColumnBatch, Key, RowInput

__all__ = ["AsyncReader", "AsyncTransferQueue"]

T = TypeVar("T")


class AsyncTransferQueue:
    """Awaitable put/get/admit over a :class:`TransferQueue` (which threads may use at the same time).

    Non-blocking operations (ack, nack, add_fields, publish_version, metrics, snapshots) are the
    sync queue's, reachable through :attr:`sync`.
    """

    def __init__(self, queue: TransferQueue) -> None:
        """Wrap ``queue``; both faces share one state."""
        self.sync = queue
        self._core = queue._core

    async def _wait(
        self, attempt: Callable[[float], T | None], timeout: float | None, on_timeout: Callable[[], Exception]
    ) -> T:
        core = self._core
        with core.lock:  # the usual call succeeds at once: no event, no listener
            if core.closed:
                raise QueueClosedError("the queue is closed")
            result = attempt(time.monotonic())
        if result is not None:
            return result
        loop = asyncio.get_running_loop()
        event = asyncio.Event()

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed; nobody is waiting any more
                loop.call_soon_threadsafe(event.set)

        deadline = None if timeout is None else time.monotonic() + timeout
        with core.lock:
            core.listeners.add(wake)
        try:
            while True:
                event.clear()
                with core.lock:
                    if core.closed:
                        raise QueueClosedError("the queue is closed")
                    now = time.monotonic()
                    result = attempt(now)
                    lease_deadline = core.next_deadline()
                if result is not None:
                    return result
                wait = None if deadline is None else deadline - now
                if wait is not None and wait <= 0:
                    raise on_timeout()
                if lease_deadline is not None:
                    until_lease = max(lease_deadline - now, 0.0) + 1e-4
                    wait = until_lease if wait is None else min(wait, until_lease)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), wait)
        finally:
            with core.lock:
                core.listeners.discard(wake)

    async def put(
        self,
        key: Key,
        fields: Mapping[str, Any],
        *,
        versions: tuple[int, int] | int | None = None,
        group_id: Hashable | None = None,
        group_size: int | None = None,
        tags: Mapping[str, int | float | str] | None = None,
        admitted: bool = False,
        timeout: float | None = None,
    ) -> None:
        """Awaitable :meth:`TransferQueue.put`."""
        await self._put(PutOne(self._core, key, fields, versions, group_id, group_size, tags, admitted), timeout)

    async def put_many(self, rows: Sequence[RowInput], *, admitted: bool = False, timeout: float | None = None) -> None:
        """Awaitable :meth:`TransferQueue.put_many`."""
        await self._put(PutMany(self._core, rows, admitted), timeout)

    async def put_columns(
        self,
        keys: Sequence[Key],
        columns: Mapping[str, Sequence[Any]],
        *,
        v_min: int | Sequence[int] | None = None,
        v_max: int | Sequence[int] | None = None,
        group_ids: Sequence[Hashable | None] | None = None,
        group_sizes: int | Sequence[int | None] | None = None,
        tags: Mapping[str, Sequence[int | float | str]] | None = None,
        admitted: bool = False,
        timeout: float | None = None,
    ) -> None:
        """Awaitable :meth:`TransferQueue.put_columns`."""
        cols = ColumnInput(keys, columns, v_min, v_max, group_ids, group_sizes, tags)
        await self._put(PutColumns(self._core, cols, admitted), timeout)

    async def _put(self, progress: PutMany | PutColumns | PutOne, timeout: float | None) -> None:
        start = time.perf_counter()
        first = True

        def attempt(now: float) -> bool | None:
            nonlocal first
            result = progress(now)
            if result is None and first:  # counted once per put, as the sync face does
                self._core.counters.put_waits += 1
                first = False
            return result

        await self._wait(attempt, timeout, lambda: progress.full_error(timeout))
        self._core.counters.put_latency_s.append(time.perf_counter() - start)

    async def get(
        self,
        task: str,
        *,
        fields: tuple[str, ...] | None = None,
        n: int | None = None,
        batcher: Batcher | None = None,
        timeout: float | None = None,
        replica: ReplicaSet | None = None,
        lease_s: float | None = None,
    ) -> Batch:
        """Awaitable :meth:`TransferQueue.get`."""
        return await self._timed_get(self.sync.get_attempt(task, fields, n, batcher, replica, lease_s), task, timeout)

    async def get_columns(
        self,
        task: str,
        *,
        fields: tuple[str, ...] | None = None,
        n: int | None = None,
        batcher: Batcher | None = None,
        timeout: float | None = None,
        replica: ReplicaSet | None = None,
        lease_s: float | None = None,
    ) -> ColumnBatch:
        """Awaitable :meth:`TransferQueue.get_columns`."""
        attempt = self.sync.get_columns_attempt(task, fields, n, batcher, replica, lease_s)
        return await self._timed_get(attempt, task, timeout)

    async def _timed_get(self, attempt: Callable[[float], T | None], task: str, timeout: float | None) -> T:
        """Awaits ``attempt`` delivering a batch (rows or columns) and records the get latency."""
        start = time.perf_counter()
        batch = await self._wait(
            attempt, timeout, lambda: QueueTimeoutError(f"task {task!r}: no batch ready within {timeout} s")
        )
        self._core.counters.get_latency_s.append(time.perf_counter() - start)
        return batch

    async def admit(self, n: int, timeout: float = 0.0) -> int:
        """Awaitable :meth:`TransferQueue.admit` (0 on timeout)."""
        core = self._core
        start = time.monotonic()
        with core.lock:
            granted = core.try_admit(n)
        if granted or n == 0 or timeout <= 0:
            return granted
        try:
            granted = await self._wait(
                lambda now: core.try_admit(n) or None, timeout, lambda: QueueTimeoutError("admit")
            )
        except QueueTimeoutError:
            granted = 0
        with core.lock:
            core.counters.admission_waits += 1
            core.counters.admission_wait_s += time.monotonic() - start
        return granted

    def reader(
        self,
        task: str,
        fields: Iterable[str] | None = None,
        batcher: Batcher | None = None,
        *,
        replica: ReplicaSet | None = None,
    ) -> AsyncReader:
        """An awaitable reader (see :meth:`TransferQueue.reader`)."""
        with self._core.lock:
            self._core.task(task)
        return AsyncReader(self, task, normalise_fields(task, fields), batcher or FixedSizeBatcher(), replica)

    def ack(self, batch: Batch | ColumnBatch | int, *, rank: int | None = None) -> None:
        """:meth:`TransferQueue.ack` (never blocks)."""
        self.sync.ack(batch, rank=rank)

    def nack(self, batch: Batch | ColumnBatch | int) -> None:
        """:meth:`TransferQueue.nack` (never blocks)."""
        self.sync.nack(batch)

    def ack_and_publish(self, batch: Batch | ColumnBatch | int, version: int, *, rank: int | None = None) -> None:
        """:meth:`TransferQueue.ack_and_publish` (never blocks)."""
        self.sync.ack_and_publish(batch, version, rank=rank)


class AsyncReader:
    """Awaitable counterpart of :class:`Reader`."""

    def __init__(
        self,
        queue: AsyncTransferQueue,
        task: str,
        fields: tuple[str, ...] | None,
        batcher: Batcher,
        replica: ReplicaSet | None,
    ) -> None:
        self.queue, self.task, self.fields, self.batcher, self.replica = queue, task, fields, batcher, replica

    async def get(
        self,
        n: int | None = None,
        timeout: float | None = None,
        *,
        ack: Batch | ColumnBatch | None = None,
        lease_s: float | None = None,
    ) -> Batch:
        """Lease the next batch, after acking ``ack`` (see :meth:`Reader.get`)."""
        check_get_arguments(self.task, n, lease_s)
        if ack is not None:
            self.ack(ack)
        return await self.queue.get(self.task, **get_kwargs(self, n, timeout, lease_s))

    async def get_columns(
        self,
        n: int | None = None,
        timeout: float | None = None,
        *,
        ack: Batch | ColumnBatch | None = None,
        lease_s: float | None = None,
    ) -> ColumnBatch:
        """Lease the next batch as columns, after acking ``ack`` (see :meth:`Reader.get_columns`)."""
        check_get_arguments(self.task, n, lease_s)
        if ack is not None:
            self.ack(ack)
        return await self.queue.get_columns(self.task, **get_kwargs(self, n, timeout, lease_s))

    def ack(self, batch: Batch | ColumnBatch) -> None:
        """Consume ``batch``."""
        self.queue.ack(batch, rank=None if self.replica is None else self.replica.rank)

    def ack_and_publish(self, batch: Batch | ColumnBatch, version: int) -> None:
        """Consume ``batch`` and publish ``version`` in one step (see :meth:`TransferQueue.ack_and_publish`)."""
        self.queue.ack_and_publish(batch, version, rank=None if self.replica is None else self.replica.rank)

    def nack(self, batch: Batch | ColumnBatch) -> None:
        """Give ``batch`` back for redelivery."""
        self.queue.nack(batch)
