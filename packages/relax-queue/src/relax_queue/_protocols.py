"""The transport-independent interface of a queue: what a producer, a reader and a controller may call.

:class:`TransferQueue` (in-process) and :class:`RayQueueClient` (a Ray actor behind a picklable client) both
implement :class:`QueueClient`; their readers implement :class:`QueueReader`. Code typed against these
protocols runs over either transport, and a new transport (another RPC layer, a shared-memory ring) is one
class that implements them; a type checker reports a missing method or a drifting signature.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from relax_queue._batchers import Batcher
from relax_queue._replica import ReplicaSet
from relax_queue._types import Batch, ColumnBatch, Key, RequeuedRow, RowInput

__all__ = ["QueueClient", "QueueReader"]


@runtime_checkable
class QueueReader(Protocol):
    """A consumer of one task with fixed fields and batcher (see :class:`~relax_queue.Reader`)."""

    def get(
        self,
        n: int | None = None,
        timeout: float | None = None,
        *,
        ack: Batch | ColumnBatch | None = None,
        lease_s: float | None = None,
    ) -> Batch:
        """Lease the next batch (``n`` in the batcher's unit) for ``lease_s`` seconds, after acking ``ack``.

        Raises:
            QueueTimeoutError: Nothing ready within ``timeout`` seconds.
            ArgumentError: ``n`` or ``lease_s`` is out of range (nothing is acked or leased).
        """
        ...

    def get_columns(
        self,
        n: int | None = None,
        timeout: float | None = None,
        *,
        ack: Batch | ColumnBatch | None = None,
        lease_s: float | None = None,
    ) -> ColumnBatch:
        """:meth:`get` delivering the batch as columns."""
        ...

    def ack(self, batch: Batch | ColumnBatch) -> None:
        """Consume ``batch``.

        Raises:
            LeaseError: The lease is unknown, settled or expired.
        """
        ...

    def ack_and_publish(self, batch: Batch | ColumnBatch, version: int) -> None:
        """Consume ``batch`` and publish ``version`` in one step.

        Raises:
            VersionError: ``version`` is not an int or goes backwards (nothing is acked).
            LeaseError: The lease is unknown, settled or expired (nothing is published).
        """
        ...

    def nack(self, batch: Batch | ColumnBatch) -> None:
        """Give ``batch`` back for redelivery."""
        ...

    def renew(self, batch: Batch | ColumnBatch, timeout_s: float | None = None) -> None:
        """Extend the lease of ``batch``."""
        ...


@runtime_checkable
class QueueClient(Protocol):
    """A queue over some transport: producers, readers, staleness pacing, snapshots and metrics
    (see :class:`~relax_queue.TransferQueue` for each method's contract)."""

    # ------------------------------------------------------------------ producers
    def put(
        self,
        key: Key,
        fields: Mapping[str, Any],
        *,
        versions: tuple[int, int] | int = 0,
        group_id: Hashable | None = None,
        group_size: int | None = None,
        tags: Mapping[str, int | float | str] | None = None,
        admitted: bool = False,
        timeout: float | None = None,
    ) -> None:
        """Store one row, or add the fields it lacks when ``key`` is stored (idempotent)."""
        ...

    def put_many(self, rows: Sequence[RowInput], *, admitted: bool = False, timeout: float | None = None) -> None:
        """Store many rows in one call."""
        ...

    def put_columns(
        self,
        keys: Sequence[Key],
        columns: Mapping[str, Sequence[Any]],
        *,
        v_min: int | Sequence[int] = 0,
        v_max: int | Sequence[int] | None = None,
        group_ids: Sequence[Hashable | None] | None = None,
        group_sizes: int | Sequence[int | None] | None = None,
        tags: Mapping[str, Sequence[int | float | str]] | None = None,
        admitted: bool = False,
        timeout: float | None = None,
    ) -> None:
        """Store many rows given as columns."""
        ...

    def add_fields(self, key: Key, fields: Mapping[str, Any]) -> bool:
        """Add fields to a stored row; False when ``key`` is not stored."""
        ...

    def add_fields_many(self, updates: Mapping[Key, Mapping[str, Any]]) -> int:
        """:meth:`add_fields` for many rows; returns how many keys were stored."""
        ...

    # ------------------------------------------------------------------ consumers
    def reader(
        self,
        task: str,
        fields: Iterable[str] | None = None,
        batcher: Batcher | None = None,
        *,
        replica: ReplicaSet | None = None,
    ) -> QueueReader:
        """A reader of ``task`` that sees rows having all of ``fields``."""
        ...

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
        """Lease the next batch of ``task`` (for ``lease_s`` seconds; ``None``: the queue's lease timeout)."""
        ...

    def ack(self, batch: Batch | ColumnBatch | int, *, rank: int | None = None) -> None:
        """Consume a leased batch."""
        ...

    def nack(self, batch: Batch | ColumnBatch | int) -> None:
        """Give a leased batch back."""
        ...

    def renew(self, batch: Batch | ColumnBatch | int, timeout_s: float | None = None) -> None:
        """Set a lease to end ``timeout_s`` from now."""
        ...

    # ------------------------------------------------------------------ staleness
    @property
    def version(self) -> int:
        """The last published policy version V."""
        ...

    def publish_version(self, version: int) -> None:
        """Publish the trainer's policy version V."""
        ...

    def ack_and_publish(self, batch: Batch | ColumnBatch | int, version: int, *, rank: int | None = None) -> None:
        """Consume a leased batch and publish the version its update produced, in one step."""
        ...

    def admit(self, n: int, timeout: float = 0.0) -> int:
        """Reserve up to ``n`` sample starts allowed by the staleness policy; returns how many."""
        ...

    def release_admission(self, n: int = 1, *, failed: bool = False) -> None:
        """Give back ``n`` admissions that will not become rows (unused, or ``failed`` samples)."""
        ...

    def refund_admission(self, n: int) -> None:
        """Give back the admission of ``n`` rows a consumer took without advancing the version."""
        ...

    def admission_capacity(self) -> int | None:
        """How many samples may start now without reserving them (``None``: unlimited)."""
        ...

    def take_requeued(self, max_n: int | None = None) -> list[RequeuedRow]:
        """Pop rows removed as stale under ``on_stale="requeue"``: the producer regenerates them."""
        ...

    # ------------------------------------------------------------------ snapshots, metrics
    def save(self, path: str) -> None:
        """Snapshot the queue to ``path``."""
        ...

    def load(self, path: str, *, reset_running: bool = True) -> None:
        """Restore a snapshot from ``path``."""
        ...

    def ready(self, task: str, fields: Sequence[str] | None = None) -> int:
        """Rows of ``task`` deliverable now."""
        ...

    def metrics(self) -> dict[str, Any]:
        """Counters and gauges of the queue."""
        ...

    def __len__(self) -> int: ...


if TYPE_CHECKING:  # the type checker proves both built-in transports implement the protocols
    from relax_queue._queue import Reader, TransferQueue
    from relax_queue._ray import RayQueueClient, RayReader

    def _transports_conform(
        local: TransferQueue, remote: RayQueueClient, local_reader: Reader, remote_reader: RayReader
    ) -> tuple[QueueClient, QueueClient, QueueReader, QueueReader]:
        return local, remote, local_reader, remote_reader
