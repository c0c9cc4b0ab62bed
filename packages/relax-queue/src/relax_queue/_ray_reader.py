"""``RayReader``: a reader over the Ray transport with the thread reader's API."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from relax_queue._batchers import Batcher
from relax_queue._reader import get_kwargs
from relax_queue._replica import ReplicaSet
from relax_queue._types import Batch, ColumnBatch

if TYPE_CHECKING:
    from relax_queue._ray import RayQueueClient

__all__ = ["RayReader"]


@dataclass
class RayReader:
    """A reader over the Ray transport (see :class:`Reader`)."""

    client: RayQueueClient
    task: str
    fields: tuple[str, ...] | None
    batcher: Batcher
    replica: ReplicaSet | None = None

    def get(
        self,
        n: int | None = None,
        timeout: float | None = None,
        *,
        ack: Batch | ColumnBatch | None = None,
        lease_s: float | None = None,
    ) -> Batch:
        """Lease the next batch, after acking ``ack`` in the same round trip (see :meth:`Reader.get`)."""
        return self.client.get(self.task, ack=ack, **get_kwargs(self, n, timeout, lease_s))

    def get_columns(
        self,
        n: int | None = None,
        timeout: float | None = None,
        *,
        ack: Batch | ColumnBatch | None = None,
        lease_s: float | None = None,
    ) -> ColumnBatch:
        """Lease the next batch as columns, after acking ``ack`` in the same round trip (see :meth:`Reader.get`)."""
        return self.client.get_columns(self.task, ack=ack, **get_kwargs(self, n, timeout, lease_s))

    def ack(self, batch: Batch | ColumnBatch) -> None:
        """Consume ``batch``."""
        self.client.ack(batch, rank=None if self.replica is None else self.replica.rank)

    def ack_and_publish(self, batch: Batch | ColumnBatch, version: int) -> None:
        """Consume ``batch`` and publish ``version`` in one round trip (see :meth:`TransferQueue.ack_and_publish`)."""
        self.client.ack_and_publish(batch, version, rank=None if self.replica is None else self.replica.rank)

    def nack(self, batch: Batch | ColumnBatch) -> None:
        """Give ``batch`` back for redelivery."""
        self.client.nack(batch)

    def renew(self, batch: Batch | ColumnBatch, timeout_s: float | None = None) -> None:
        """Extend the lease of ``batch``."""
        self.client.renew(batch, timeout_s)
