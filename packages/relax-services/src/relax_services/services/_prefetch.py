"""The Trainer's next batch leased while the current update computes (τ ≥ 1, queue in another process).

Over the Ray transport a get is a round trip to the queue actor plus the batch's decoding, paid between two
updates. At τ ≥ 1 the next batch may already exist while an update computes (pacing admits τ batches ahead), so a
background thread leases it then, and the next update starts without that wait. At τ = 0 the next batch cannot
exist before the new version is published, so nothing is prefetched.

A batch leased during the update that produces version V + 1 was checked by the queue against V, but is consumed
by the update that starts at V + 1: before it is used every row is checked again at that version, and a batch with
a row past τ there is given back (nacked), so the queue applies its own stale-row policy to it at the version that
counts; the rows' staleness is then restated at that version. The guarantee (no update consumes a sample with
staleness > τ) is the queue's, unchanged.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor

from relax_queue import Batch, QueueReader, QueueTimeoutError, RelaxQueueError

__all__ = ["BatchPrefetch"]


class BatchPrefetch:
    """Leases a reader's next batch in a background thread; one batch at most in flight.

    Args:
        reader: the Trainer's reader (its gets lease whole groups).
        tau: the staleness bound (``None``: unbounded); must be >= 1.
        lease_s: how long each lease lasts (the whole update).
        timeout_s: how long one background get waits for a batch.
    """

    def __init__(self, reader: QueueReader, tau: int | None, lease_s: float, timeout_s: float) -> None:
        if tau is not None and tau < 1:
            raise ValueError(f"prefetching the next batch needs staleness.tau >= 1 (or unbounded), got {tau}")
        self._reader, self._tau, self._lease_s, self._timeout_s = reader, tau, lease_s, timeout_s
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="trainer-prefetch")
        self._next: Future[Batch] | None = None
        self.given_back = 0
        """Prefetched batches handed back because a row would have been past τ at the version that consumes it."""

    def start(self) -> None:
        """Lease the next batch in the background (nothing when one is already on its way)."""
        if self._next is None:
            self._next = self._pool.submit(self._reader.get, timeout=self._timeout_s, lease_s=self._lease_s)

    def take(self, version: int) -> Batch | None:
        """The prefetched batch, for the update that starts at ``version``: waits for the background get; ``None``
        when none was started, none came in time, or one was given back for being past τ at ``version``.

        Raises:
            RelaxQueueError: what the background get raised besides a timeout (a closed queue, ...).
        """
        future, self._next = self._next, None
        if future is None:
            return None
        try:
            batch = future.result()
        except QueueTimeoutError:
            return None
        if self._tau is not None and any(version - row.v_min > self._tau for row in batch.rows):
            self._reader.nack(batch)  # redelivered through the queue's staleness check at the current version
            self.given_back += 1
            return None
        for row in batch.rows:  # leased at an older version: its staleness is that of the update consuming it
            row.staleness, row.stale = version - row.v_min, False
        return dataclasses.replace(batch, version=version)

    def give_back(self) -> None:
        """Nack a prefetched batch (when the loop will not train on it: the run's last update is done)."""
        future, self._next = self._next, None
        if future is None:
            return
        try:
            batch = future.result()
        except Exception:
            return
        self._reader.nack(batch)

    def close(self) -> None:
        """Give a prefetched batch back and stop the thread (the loop that used it has stopped)."""
        try:
            self.give_back()
        except RelaxQueueError:  # a closed queue: its leases are saved as redeliveries, or expire
            pass
        finally:
            self._pool.shutdown(wait=True)
