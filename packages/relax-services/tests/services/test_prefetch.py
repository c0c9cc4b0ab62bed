"""The Trainer's next batch leased while an update computes: only what τ allows at the version that consumes it."""

from __future__ import annotations

import pytest

from relax_queue import (
    BoundedStaleness,
    GroupBatcher,
    QueueConfig,
    QueueTimeoutError,
    RowInput,
    TaskSpec,
    TransferQueue,
)
from relax_services.services._prefetch import BatchPrefetch

GROUP = 4


def _queue(tau: int | None) -> TransferQueue:
    return TransferQueue(
        QueueConfig(
            tasks=(TaskSpec("trainer", check_staleness=True),),
            staleness=BoundedStaleness(tau=tau, on_stale="drop", batch_size=GROUP),
            lease_timeout_s=30.0,
        )
    )


def _put_group(q: TransferQueue, name: str, version: int) -> None:
    q.put_many(
        [RowInput(f"{name}/{i}", {"x": i}, versions=version, group_id=name, group_size=GROUP) for i in range(GROUP)]
    )


def test_a_prefetched_batch_is_the_next_one_with_its_staleness_at_the_consuming_version() -> None:
    q = _queue(tau=2)
    reader = q.reader("trainer", ["x"], GroupBatcher(1))
    _put_group(q, "a", 0)
    _put_group(q, "b", 0)
    current = reader.get(timeout=5)  # the batch the update trains on, at version 0
    prefetch = BatchPrefetch(reader, tau=2, lease_s=600.0, timeout_s=5.0)
    try:
        prefetch.start()  # while the update computes
        reader.ack_and_publish(current, 1)
        got = prefetch.take(version=1)
        assert got is not None and [r.group_id for r in got.rows] == ["b"] * GROUP
        assert got.lease_timeout_s == 600.0 and got.version == 1
        # Leased at version 0 (staleness 0 there), consumed by the update starting at version 1: staleness 1 - 0.
        assert [r.staleness for r in got.rows] == [1 - 0] * GROUP
        reader.ack_and_publish(got, 2)
        assert (q.version, len(q)) == (2, 0)
    finally:
        prefetch.close()


def test_a_batch_past_tau_at_the_consuming_version_goes_back_to_the_queue() -> None:
    tau = 1
    q = _queue(tau=tau)
    reader = q.reader("trainer", ["x"], GroupBatcher(1))
    _put_group(q, "old", 0)
    q.publish_version(1)  # the queue checks 1 - 0 = 1 <= tau: deliverable now
    prefetch = BatchPrefetch(reader, tau=tau, lease_s=600.0, timeout_s=5.0)
    try:
        prefetch.start()
        assert prefetch.take(version=1 + 1) is None  # consumed at 2 it would be 2 - 0 > tau
        assert prefetch.given_back == 1
        q.publish_version(2)
        with pytest.raises(QueueTimeoutError):  # the queue's own policy (drop) at version 2: never consumed
            reader.get(timeout=0.05)
        assert q.metrics()["drops"] == GROUP and len(q) == 0
    finally:
        prefetch.close()


def test_nothing_started_or_nothing_in_time_is_no_batch_and_give_back_returns_the_rows() -> None:
    q = _queue(tau=None)
    reader = q.reader("trainer", ["x"], GroupBatcher(1))
    prefetch = BatchPrefetch(reader, tau=None, lease_s=600.0, timeout_s=0.05)
    try:
        assert prefetch.take(version=0) is None  # none started
        prefetch.start()
        assert prefetch.take(version=0) is None  # the queue is empty: the background get timed out
        _put_group(q, "a", 0)
        prefetch.start()
        prefetch.give_back()
        assert q.ready("trainer", ["x"]) == GROUP  # leased, then nacked: deliverable again
        assert [r.deliveries for r in reader.get(timeout=5).rows] == [2] * GROUP
    finally:
        prefetch.close()


def test_prefetching_is_refused_at_tau_zero() -> None:
    q = _queue(tau=0)
    with pytest.raises(ValueError, match="tau >= 1"):
        BatchPrefetch(q.reader("trainer", ["x"], GroupBatcher(1)), tau=0, lease_s=600.0, timeout_s=1.0)
