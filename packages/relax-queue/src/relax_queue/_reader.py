"""``Reader``: a consumer of one task of a :class:`~relax_queue.TransferQueue` with fixed fields and batcher."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from relax_queue._batchers import Batcher
from relax_queue._progress import check_get_arguments
from relax_queue._replica import ReplicaSet
from relax_queue._types import Batch, ColumnBatch

if TYPE_CHECKING:
    from relax_queue._queue import TransferQueue

__all__ = ["Reader", "get_kwargs"]


class _ReaderParts(Protocol):
    fields: tuple[str, ...] | None
    batcher: Batcher
    replica: ReplicaSet | None


def get_kwargs(reader: _ReaderParts, n: int | None, timeout: float | None, lease_s: float | None) -> dict[str, Any]:
    """The keyword arguments of a reader's ``get`` / ``get_columns`` call to its queue: the reader's fields, batcher
    and replica set with the call's ``n``, ``timeout`` and ``lease_s`` (every transport's reader forwards these)."""
    return {
        "fields": reader.fields,
        "n": n,
        "batcher": reader.batcher,
        "timeout": timeout,
        "replica": reader.replica,
        "lease_s": lease_s,
    }


class Reader:
    """A consumer of one task with fixed fields, batcher and (optional) replica set."""

    def __init__(
        self,
        queue: TransferQueue,
        task: str,
        fields: tuple[str, ...] | None,
        batcher: Batcher,
        replica: ReplicaSet | None,
    ) -> None:
        self.queue, self.task, self.fields, self.batcher, self.replica = queue, task, fields, batcher, replica

    def get(
        self,
        n: int | None = None,
        timeout: float | None = None,
        *,
        ack: Batch | ColumnBatch | None = None,
        lease_s: float | None = None,
    ) -> Batch:
        """Lease the next batch (``n`` in the batcher's unit; ``None``: its default size).

        Args:
            n: batch size in the batcher's unit.
            timeout: seconds to wait for a batch; ``None`` waits forever.
            ack: a batch this reader finished, acked first (as :meth:`ack`, even when no new
                batch comes in time). On the Ray transport this saves the ack's round trip.
            lease_s: seconds the lease lasts from delivery (``None``: the queue's ``lease_timeout_s``), set with
                the lease itself: a consumer that needs the batch longer makes no renewal call.

        Raises:
            QueueTimeoutError: nothing ready within ``timeout`` seconds.
            LeaseError: ``ack`` could not be acked (nothing is leased then).
            ArgumentError: ``n`` or ``lease_s`` is out of range (nothing is acked or leased).
        """
        check_get_arguments(self.task, n, lease_s)
        if ack is not None:
            self.ack(ack)
        return self.queue.get(self.task, **get_kwargs(self, n, timeout, lease_s))

    def get_columns(
        self,
        n: int | None = None,
        timeout: float | None = None,
        *,
        ack: Batch | ColumnBatch | None = None,
        lease_s: float | None = None,
    ) -> ColumnBatch:
        """:meth:`get` delivering the batch as columns.

        Raises:
            QueueTimeoutError: nothing ready within ``timeout`` seconds.
            LeaseError: ``ack`` could not be acked (nothing is leased then).
            ArgumentError: ``n`` or ``lease_s`` is out of range (nothing is acked or leased).
        """
        check_get_arguments(self.task, n, lease_s)
        if ack is not None:
            self.ack(ack)
        return self.queue.get_columns(self.task, **get_kwargs(self, n, timeout, lease_s))

    def ack(self, batch: Batch | ColumnBatch) -> None:
        """Consume ``batch`` (for a replica set: this rank's ack)."""
        self.queue.ack(batch, rank=None if self.replica is None else self.replica.rank)

    def ack_and_publish(self, batch: Batch | ColumnBatch, version: int) -> None:
        """Consume ``batch`` and publish ``version`` in one step (see :meth:`TransferQueue.ack_and_publish`)."""
        self.queue.ack_and_publish(batch, version, rank=None if self.replica is None else self.replica.rank)

    def nack(self, batch: Batch | ColumnBatch) -> None:
        """Give ``batch`` back for redelivery."""
        self.queue.nack(batch)

    def renew(self, batch: Batch | ColumnBatch, timeout_s: float | None = None) -> None:
        """Extend the lease of ``batch``."""
        self.queue.renew(batch, timeout_s)
