"""``TransferQueue``: the thread-safe, blocking (sync) face of the queue."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

from relax_queue._batchers import Batcher, FixedSizeBatcher
from relax_queue._columnar import ColumnInput
from relax_queue._config import QueueConfig
from relax_queue._core import QueueCore
from relax_queue._errors import QueueTimeoutError, VersionError
from relax_queue._metrics import queue_metrics
from relax_queue._payload import PayloadPacker
from relax_queue._payload import open_payloads as _open_payloads
from relax_queue._progress import (
    PutColumns,
    PutMany,
    PutOne,
    attempt_once,
    batch_lease_id,
    check_open,
    get_attempt,
    get_columns_attempt,
    normalise_fields,
    timed_get,
    wait_for,
)
from relax_queue._reader import Reader
from relax_queue._replica import ReplicaCoordinator, ReplicaSet
from relax_queue._settle import ack_and_publish, check_version, check_version_forward
from relax_queue._snapshot import atomic_write, core_state, load_core_state, read_state
from relax_queue._types import Batch, ColumnBatch, Key, RequeuedRow, RowInput

__all__ = ["Reader", "TransferQueue", "VersionError"]


class TransferQueue:
    """Bounded, version-tagged, columnar data bus, safe to share between threads.

    Build it from a :class:`QueueConfig` (or its fields as keyword arguments)::

        q = TransferQueue(QueueConfig(
            tasks=[TaskSpec("reward"), TaskSpec("trainer", check_staleness=True)],
            capacity=Capacity(max_rows=4096, max_bytes=2**30),
            staleness=BoundedStaleness(tau=2, on_stale="drop", batch_size=256),
        ))

    Use :class:`AsyncTransferQueue` over the same instance from asyncio code.
    """

    def __init__(self, config: QueueConfig | None = None, **config_fields: Any) -> None:
        """Create an empty queue from ``config`` or from ``QueueConfig(**config_fields)``."""
        if config is None:
            config = QueueConfig(**config_fields)
        elif config_fields:
            raise TypeError("pass either a QueueConfig or its fields as keyword arguments, not both")
        self._core = QueueCore(config)
        self._replicas = ReplicaCoordinator()

    @property
    def config(self) -> QueueConfig:
        """The queue's configuration."""
        return self._core.config

    # ------------------------------------------------------------------ producers
    def put(
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
        """Store one row, or add the fields it lacks when ``key`` is already stored (idempotent).

        Args:
            key: unique row key. A key already consumed by every task is ignored (no redelivery).
            fields: the row's columns.
            versions: ``(v_min, v_max)`` policy versions that produced the row (an int v is (v, v); ints
                >= 0, numpy integers accepted). ``None``: 0 for a new row; a put of a stored key that
                gives versions or a group must repeat the stored ones.
            group_id: group (e.g. GRPO prompt) of the row; groups are delivered whole.
            group_size: rows in the group; required with ``group_id``.
            tags: scalar metadata, e.g. ``{"num_tokens": 37}``.
            admitted: the row consumes one admission granted by :meth:`admit` when it is stored; a put of a
                key already stored or retired (a retry, a regeneration) consumes none.
            timeout: seconds to wait for capacity; ``None`` waits forever.

        Raises:
            QueueFullError: the queue stayed full for ``timeout`` seconds.
            FieldTypeError, GroupError, RowTooLargeError: the row is malformed, contradicts the stored
                row of its key, or can never fit.
            GroupDeadlockError: the queue is full of incomplete groups (waiting can never help).
            QueueClosedError: the queue is closed.
        """
        self._put(PutOne(self._core, key, fields, versions, group_id, group_size, tags, admitted), timeout)

    def put_many(self, rows: Sequence[RowInput], *, admitted: bool = False, timeout: float | None = None) -> None:
        """Store many rows in one call (see :meth:`put`); rows before a failing one stay stored."""
        self._put(PutMany(self._core, rows, admitted), timeout)

    def put_columns(
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
        """Store many rows given as columns: row ``i`` is ``keys[i]`` with ``columns[f][i]`` for each field ``f``.

        The same as :meth:`put_many` of those rows (idempotent per key, fields added to known keys,
        groups, capacity waits), without building a :class:`RowInput` per row. New ungrouped rows
        that fit are stored in one bulk step.

        Args:
            keys: the row keys.
            columns: field name to one value per key (lists, tuples, arrays: row ``i`` gets item ``i``).
            v_min: the rows' oldest policy version: one int >= 0 for all rows, or one per key (numpy
                integers and arrays accepted). ``None`` (with ``v_max``): 0 for new rows, and stored
                keys are not checked; given versions must match a stored key's.
            v_max: the rows' newest policy version, likewise; ``None``: equal to ``v_min``.
            group_ids: one group id (or ``None``) per key.
            group_sizes: the group size: one int for all rows, or one per key.
            tags: tag name to one scalar per key, e.g. ``{"num_tokens": [37, 12]}``.
            admitted: every newly stored row consumes one admission granted by :meth:`admit` (a key already
                stored or retired consumes none).
            timeout: seconds to wait for capacity; ``None`` waits forever.

        Raises:
            FieldTypeError: a column or argument does not have one value per key, a field name is
                not a str, or a version is not an int >= 0 (nothing is stored).
            QueueFullError, GroupError, RowTooLargeError: as :meth:`put_many` (earlier rows stay stored).
        """
        self._put(
            PutColumns(self._core, ColumnInput(keys, columns, v_min, v_max, group_ids, group_sizes, tags), admitted),
            timeout,
        )

    def _put(self, progress: PutMany | PutColumns | PutOne, timeout: float | None) -> None:
        start = time.perf_counter()
        core = self._core
        if attempt_once(self._core, progress) is None:
            with core.lock:
                core.counters.put_waits += 1
            wait_for(self._core, progress, timeout, lambda: progress.full_error(timeout))
        core.counters.put_latency_s.append(time.perf_counter() - start)

    def add_fields(self, key: Key, fields: Mapping[str, Any]) -> bool:
        """Add fields to a stored row (fields it already has are left unchanged); never blocks.

        Returns:
            ``False`` when ``key`` is not stored (already consumed, dropped, or never put).
        """
        with self._core.lock:
            check_open(self._core, "add_fields")
            found = self._core.add_fields(key, fields)
            self._core.notify()
        return found

    def add_fields_many(self, updates: Mapping[Key, Mapping[str, Any]]) -> int:
        """:meth:`add_fields` for many rows in one call; returns how many keys were stored."""
        core = self._core
        with core.lock:
            check_open(core, "add_fields_many")
            try:
                found = sum(core.add_fields(key, fields) for key, fields in updates.items())
            finally:  # fields added before a malformed update stay: their readers must wake
                core.notify()
        return found

    # ------------------------------------------------------------------ consumers
    def reader(
        self,
        task: str,
        fields: Iterable[str] | None = None,
        batcher: Batcher | None = None,
        *,
        replica: ReplicaSet | None = None,
    ) -> Reader:
        """A reader of ``task`` that sees rows having all of ``fields`` (``None``: any row, all fields).

        Args:
            task: a registered task.
            fields: fields the reader needs; delivered rows carry exactly these.
            batcher: how batches are formed; default ``FixedSizeBatcher(1)`` (``get(n)`` sets the size).
            replica: makes every rank of a replica set receive identical batches.
        """
        with self._core.lock:
            self._core.task(task)  # fail early on an unknown task
        return Reader(self, task, normalise_fields(task, fields), batcher or FixedSizeBatcher(), replica)

    def get(
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
        """Lease the next batch of ``task`` (what :meth:`Reader.get` calls).

        Args:
            lease_s: seconds the lease lasts from delivery (``None``: the config's ``lease_timeout_s``); a consumer
                that knows it needs the batch longer says so here instead of renewing the lease after the get.

        Raises:
            QueueTimeoutError: no batch was ready within ``timeout`` seconds.
            UnknownTaskError: ``task`` is not registered.
            ArgumentError: ``n`` or ``lease_s`` is out of range (nothing is leased).
        """
        return timed_get(
            self._core, self.get_attempt(task, fields, n, batcher, replica, lease_s), task, fields, n, timeout
        )

    def get_columns(
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
        """:meth:`get` delivering the batch as columns (what :meth:`Reader.get_columns` calls).

        Raises:
            QueueTimeoutError: no batch was ready within ``timeout`` seconds.
            UnknownTaskError: ``task`` is not registered.
            FieldTypeError: ``fields`` is ``None`` and the rows of the batch carry different fields.
        """
        attempt = self.get_columns_attempt(task, fields, n, batcher, replica, lease_s)
        return timed_get(self._core, attempt, task, fields, n, timeout)

    def get_attempt(
        self,
        task: str,
        fields: tuple[str, ...] | None,
        n: int | None,
        batcher: Batcher | None,
        replica: ReplicaSet | None,
        lease_s: float | None = None,
    ) -> Callable[[float], Batch | None]:
        """A non-blocking get (caller holds the lock), retried by the sync and asyncio waits.

        Raises:
            ArgumentError: ``n`` is not ``None`` or an int >= 1, or ``lease_s`` not ``None`` or a number > 0.
        """
        return get_attempt(self._core, self._replicas, task, fields, n, batcher, replica, lease_s)

    def get_columns_attempt(
        self,
        task: str,
        fields: tuple[str, ...] | None,
        n: int | None,
        batcher: Batcher | None,
        replica: ReplicaSet | None,
        lease_s: float | None = None,
    ) -> Callable[[float], ColumnBatch | None]:
        """:meth:`get_attempt` delivering columns."""
        return get_columns_attempt(self._core, self._replicas, task, fields, n, batcher, replica, lease_s)

    def ack(self, batch: Batch | ColumnBatch | int, *, rank: int | None = None) -> None:
        """Consume a leased batch: its rows are never delivered to that task again.

        Args:
            batch: the batch or its lease id.
            rank: for replica sets, the acking rank; the lease is acked when every rank did.

        Raises:
            LeaseError: the lease is unknown, settled, or expired (its rows were redelivered).
        """
        lease_id = batch_lease_id(batch)
        core = self._core
        with core.lock:
            check_open(core, "ack")
            heap = core.lease_heap
            if heap and heap[0][0] <= time.monotonic():
                core.expire(time.monotonic())  # a lease past its deadline can no longer be acked
            if rank is not None and not self._replicas.ack(lease_id, rank):
                return
            core.ack(lease_id)
            core.notify()

    def nack(self, batch: Batch | ColumnBatch | int) -> None:
        """Give a leased batch back: its rows are redelivered to the task first."""
        with self._core.lock:
            check_open(self._core, "nack")
            self._core.expire(time.monotonic())
            self._core.nack(batch_lease_id(batch))
            self._core.notify()

    def renew(self, batch: Batch | ColumnBatch | int, timeout_s: float | None = None) -> None:
        """Set a lease to end ``timeout_s`` from now (default: the lease timeout; <= 0 expires it now)."""
        with self._core.lock:
            check_open(self._core, "renew")
            self._core.expire(time.monotonic())
            self._core.renew(batch_lease_id(batch), time.monotonic(), timeout_s)

    # ------------------------------------------------------------------ staleness
    @property
    def version(self) -> int:
        """The last published policy version V."""
        return self._core.version

    def publish_version(self, version: int) -> None:
        """Publish the trainer's policy version V (number of optimizer updates so far).

        Raises:
            VersionError: ``version`` is not an int or is below the current version.
        """
        check_version(version)
        with self._core.lock:
            check_open(self._core, "publish_version")
            check_version_forward(self._core, version)
            self._core.version = version
            self._core.notify()

    def ack_and_publish(self, batch: Batch | ColumnBatch | int, version: int, *, rank: int | None = None) -> None:
        """:meth:`ack` ``batch``, then :meth:`publish_version` ``version``, as one step: what a trainer calls when
        an update is done.

        No caller sees the batch consumed without the version, or the version without the batch consumed (a
        snapshot, an admission, a reader's staleness check); over Ray it is one round trip instead of two.

        Args:
            batch: the batch the update consumed, or its lease id.
            version: the version the update produced.
            rank: for replica sets, the acking rank; the call whose ack settles the lease (the last rank's)
                publishes the version, so it never becomes visible before the batch is consumed.

        Raises:
            VersionError: ``version`` is not an int or is below the current version (nothing is acked).
            LeaseError: the lease is unknown, settled, or expired (nothing is published).
            QueueClosedError: the queue is closed.
        """
        lease_id = batch_lease_id(batch)
        check_version(version)
        with self._core.lock:
            check_open(self._core, "ack_and_publish")
            ack_and_publish(self._core, self._replicas, lease_id, version, rank)

    def admit(self, n: int, timeout: float = 0.0) -> int:
        """Reserve up to ``n`` sample starts allowed by the staleness policy.

        Each granted admission must end as a put with ``admitted=True`` or be given back with
        :meth:`release_admission`.

        Args:
            n: samples the producer would like to start.
            timeout: seconds to wait until at least one is allowed (0: answer now).

        Returns:
            How many may start now (0 on timeout).
        """
        core = self._core
        start = time.monotonic()
        with core.lock:
            check_open(core, "admit")
            granted = core.try_admit(n)
        if granted or n == 0 or timeout <= 0:
            return granted
        try:
            granted = wait_for(
                self._core, lambda now: core.try_admit(n) or None, timeout, lambda: QueueTimeoutError("admit")
            )
        except QueueTimeoutError:
            granted = 0
        with core.lock:
            core.counters.admission_waits += 1
            core.counters.admission_wait_s += time.monotonic() - start
        return granted

    def release_admission(self, n: int = 1, *, failed: bool = False) -> None:
        """Give back ``n`` admissions that will not become rows (unused, or ``failed`` samples)."""
        with self._core.lock:
            check_open(self._core, "release_admission")
            self._core.release_admission(n, failed)

    def refund_admission(self, n: int) -> None:
        """Give back the admission of ``n`` rows a consumer took without advancing the version (e.g. groups it
        filtered out as carrying no signal), so that producers are not paced as if they had been trained on.

        Raises:
            AdmissionError: ``n`` is not an int >= 0.
        """
        with self._core.lock:
            check_open(self._core, "refund_admission")
            self._core.refund_admission(n)

    def admission_capacity(self) -> int | None:
        """How many samples may start now without reserving them (``None``: unlimited)."""
        with self._core.lock:
            return self._core.admission_capacity()

    def take_requeued(self, max_n: int | None = None) -> list[RequeuedRow]:
        """Pop rows removed as stale under ``on_stale="requeue"``: the producer regenerates them."""
        with self._core.lock:
            check_open(self._core, "take_requeued")
            requeued = self._core.requeued
            count = len(requeued) if max_n is None else min(max_n, len(requeued))
            taken, self._core.requeued = requeued[:count], requeued[count:]
        return taken

    # ------------------------------------------------------------------ snapshots
    def state_dict(self, resolve: Callable[[Any], Any] | None = None) -> dict[str, Any]:
        """The full state as plain containers (leased rows are saved as to-be-redelivered)."""
        with self._core.lock:
            return core_state(self._core, resolve)

    def load_state_dict(self, state: dict[str, Any], *, reset_running: bool = True) -> None:
        """Replace the state by ``state``; leases in it are redelivered.

        Args:
            state: from :meth:`state_dict`.
            reset_running: forget admissions granted but not yet put (their producers are gone
                after a restart); ``False`` keeps the saved running count.
        """
        with self._core.lock:
            check_open(self._core, "load_state_dict")
            load_core_state(self._core, state, reset_running)
            self._replicas.reset()

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`state_dict` to ``path`` atomically (temp file, fsync, rename).

        Field values whose classes live outside :data:`~relax_queue._payload.PLAIN_MODULES` are written as
        :class:`~relax_queue._payload.Payload` bytes (each distinct object once), as the Ray transport holds
        them: a queue actor can load this file without importing the values' modules.
        """
        atomic_write(path, self.state_dict(resolve=PayloadPacker().pack))

    def load(self, path: str | os.PathLike[str], *, reset_running: bool = True, open_payloads: bool = True) -> None:
        """Restore the state saved at ``path`` by :meth:`save` (or by a Ray queue actor).

        Args:
            path: the snapshot file.
            reset_running: see :meth:`load_state_dict`.
            open_payloads: unpickle the file's :class:`~relax_queue._payload.Payload` values (in-process readers
                get the values themselves); a queue actor keeps them packed for its clients to open.
        """
        state = read_state(path)
        if open_payloads and isinstance(state.get("rows"), list):  # not a snapshot: load_state_dict says so
            _open_payloads((row["fields"] for row in state["rows"]), dict.items)
        self.load_state_dict(state, reset_running=reset_running)

    # ------------------------------------------------------------------ introspection
    def __len__(self) -> int:
        return self._core.row_count()

    def ready(self, task: str, fields: Sequence[str] | None = None) -> int:
        """How many rows ``task`` could be handed now: not leased or consumed by it, every one of ``fields`` present.

        ``metrics()``'s per-task ``backlog`` counts rows still waiting for fields too.

        Raises:
            UnknownTaskError: ``task`` is not registered.
        """
        with self._core.lock:
            return self._core.ready(task, None if fields is None else tuple(fields))

    def metrics(self) -> dict[str, Any]:
        """A plain dict of depth, backlog, admission, staleness and latency metrics."""
        with self._core.lock:
            return queue_metrics(self._core, time.monotonic())

    def close(self) -> None:
        """Close the queue for good: blocked calls and every later call that would change it raise
        :class:`QueueClosedError`.

        That is put*, add_fields*, get*, ack, nack, renew, admit, release/refund_admission,
        publish_version, ack_and_publish, take_requeued and load*. What only reads it keeps working (metrics, ready,
        len, version, admission_capacity, state_dict, save), so a stopped pipeline can still be
        inspected and snapshotted; rows leased at close are saved as redeliveries.
        """
        with self._core.lock:
            self._core.closed = True
            self._core.notify()
