"""An update settled in fewer calls: the lease length given at lease time (``get(lease_s=...)``) and the ack with the
version publish in one call (``ack_and_publish``), with the same semantics and errors on every transport."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from relax_queue import (
    ArgumentError,
    BoundedStaleness,
    Capacity,
    FixedSizeBatcher,
    GroupBatcher,
    LeaseError,
    QueueClosedError,
    QueueConfig,
    ReplicaSet,
    RowInput,
    TaskSpec,
    TransferQueue,
    VersionError,
    create_ray_queue,
)

TAU, BATCH = 1, 2


def _config(lease_timeout_s: float) -> QueueConfig:
    return QueueConfig(
        tasks=(TaskSpec("trainer", check_staleness=True),),
        capacity=Capacity(max_rows=100),
        staleness=BoundedStaleness(tau=TAU, on_stale="drop", batch_size=BATCH),
        lease_timeout_s=lease_timeout_s,
    )


_names = iter(range(10_000))


@pytest.fixture(params=["thread", pytest.param("ray", marks=pytest.mark.integration)])
def make(request: pytest.FixtureRequest) -> Iterator[Any]:
    """Factory of queues on the transport of the parameter: ``make(lease_timeout_s)``."""
    made: list[Any] = []

    def build(lease_timeout_s: float = 30.0) -> Any:
        if request.param == "thread":
            queue: Any = TransferQueue(_config(lease_timeout_s))
        else:
            ray = request.getfixturevalue("ray_session")
            ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
            queue = create_ray_queue(f"settle-{next(_names)}", _config(lease_timeout_s))
        made.append(queue)
        return queue

    yield build
    for queue in made:
        if hasattr(queue, "shutdown"):
            queue.shutdown()


def _fill(queue: Any, n: int = 6) -> None:
    queue.put_many([RowInput(i, {"x": i}) for i in range(n)])


def test_a_lease_given_at_lease_time_outlasts_the_default(make: Any) -> None:
    q = make(lease_timeout_s=0.2)
    _fill(q)
    reader = q.reader("trainer", ["x"], FixedSizeBatcher(2))
    held = reader.get(timeout=10, lease_s=600.0)
    short = reader.get(timeout=10)  # the queue's default: 0.2 s
    assert (held.lease_timeout_s, short.lease_timeout_s) == (600.0, 0.2)
    time.sleep(0.5)  # past the default, far inside 600 s
    with pytest.raises(LeaseError, match=str(short.lease_id)):
        reader.ack(short)  # the default lease expired: its rows went back
    reader.ack(held)  # still leased: acked
    # The expired rows come back first (their second delivery), the held ones never again.
    again = reader.get(timeout=10)
    assert (again.keys, [r.deliveries for r in again.rows]) == ([2, 3], [2, 2])
    reader.ack(again)
    assert q.metrics()["tasks"]["trainer"]["acked"] == 4


def test_a_short_lease_given_at_lease_time_expires_and_redelivers(make: Any) -> None:
    q = make(lease_timeout_s=600.0)
    _fill(q, 2)
    reader = q.reader("trainer", ["x"], FixedSizeBatcher(2))
    first = reader.get_columns(timeout=10, lease_s=0.05)
    assert first.lease_timeout_s == 0.05
    again = reader.get_columns(timeout=30)  # waits for nothing but that lease's end
    assert (again.keys, again.deliveries, again.lease_timeout_s) == ([0, 1], [2, 2], 600.0)
    with pytest.raises(LeaseError):
        reader.ack(first)


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, "60", True, None])
def test_a_bad_lease_length_is_refused_before_anything_is_acked_or_leased(make: Any, bad: Any) -> None:
    q = make()
    _fill(q, 4)
    reader = q.reader("trainer", ["x"], FixedSizeBatcher(2))
    done = reader.get(timeout=10)
    if bad is None:  # the default is valid: the control case of this test
        reader.get(timeout=10, ack=done, lease_s=bad)
        assert (q.metrics()["tasks"]["trainer"]["acked"], q.ready("trainer")) == (2, 0)
        return
    for get in (reader.get, reader.get_columns):
        with pytest.raises(ArgumentError, match=r"task 'trainer'.*lease_s.*" + repr(bad).replace(".", r"\.")):
            get(timeout=10, ack=done, lease_s=bad)
    assert (q.metrics()["tasks"]["trainer"]["acked"], q.ready("trainer")) == (0, 2)  # nothing acked, nothing leased
    reader.ack(done)  # the lease it carried is still held


def _pacing(version: int, accepted: int, running: int) -> int:
    """AReaL's admission capacity (tau + V + 1) * B - (accepted + running), computed here independently."""
    return (TAU + version + 1) * BATCH - (accepted + running)


def test_ack_and_publish_consumes_the_batch_and_moves_the_version(make: Any) -> None:
    q = make()
    assert q.admit(6) == _pacing(0, 0, 0) == 4
    q.put_many([RowInput(i, {"x": i}) for i in range(4)], admitted=True)
    reader = q.reader("trainer", ["x"], FixedSizeBatcher(2))
    batch = reader.get(timeout=10)
    trips = getattr(q, "round_trips", None)
    reader.ack_and_publish(batch, 1)
    if trips is not None:
        assert q.round_trips == trips + 1  # both in one actor call
    assert q.version == 1
    m = q.metrics()
    assert (m["tasks"]["trainer"]["acked"], len(q), q.ready("trainer")) == (2, 2, 2)
    assert q.admission_capacity() == _pacing(1, 4, 0) == 2  # the new version opened admission
    nxt = reader.get(timeout=10)
    assert nxt.keys == [2, 3] and nxt.version == 1  # the consumed rows never come back
    q.ack_and_publish(nxt, 2)  # the client method as well
    assert (q.version, len(q)) == (2, 0)


def test_ack_and_publish_refusals_change_nothing(make: Any) -> None:
    q = make()
    _fill(q, 4)
    reader = q.reader("trainer", ["x"], FixedSizeBatcher(2))
    batch = reader.get(timeout=10)
    q.publish_version(3)
    for bad in (2.0, "4", True, None):
        with pytest.raises(VersionError, match="must be an int"):
            reader.ack_and_publish(batch, bad)
    with pytest.raises(VersionError, match=f"current 3, got 2.*lease {batch.lease_id} was not acked"):
        reader.ack_and_publish(batch, 2)
    assert (q.version, q.metrics()["tasks"]["trainer"]["acked"]) == (3, 0)
    with pytest.raises(LeaseError, match=f"lease {batch.lease_id + 100}"):
        q.ack_and_publish(batch.lease_id + 100, 4)
    assert q.version == 3  # an unknown lease published nothing
    reader.ack_and_publish(batch, 3)  # the same version again is allowed, as publish_version allows it
    with pytest.raises(LeaseError, match=f"lease {batch.lease_id}"):
        reader.ack_and_publish(batch, 4)  # settled already
    assert (q.version, q.metrics()["tasks"]["trainer"]["acked"]) == (3, 2)


def test_ack_and_publish_of_an_expired_lease_publishes_nothing(make: Any) -> None:
    q = make(lease_timeout_s=600.0)
    _fill(q, 2)
    reader = q.reader("trainer", ["x"], FixedSizeBatcher(2))
    batch = reader.get(timeout=10, lease_s=0.05)
    again = reader.get(timeout=30)  # delivered again once that lease ended
    with pytest.raises(LeaseError, match=str(batch.lease_id)):
        reader.ack_and_publish(batch, 1)
    assert q.version == 0
    reader.ack_and_publish(again, 1)
    assert (q.version, len(q)) == (1, 0)


def test_ack_and_publish_on_a_closed_queue_raises_and_changes_nothing(make: Any) -> None:
    q = make()
    _fill(q, 2)
    batch = q.reader("trainer", ["x"], FixedSizeBatcher(2)).get(timeout=10)
    q.close()
    with pytest.raises(QueueClosedError, match="ack_and_publish"):
        q.ack_and_publish(batch, 1)
    assert (q.version, q.metrics()["tasks"]["trainer"]["acked"]) == (0, 0)


def test_a_replica_set_publishes_when_its_last_rank_acks(make: Any) -> None:
    q = make()
    q.put_many([RowInput(i, {"x": i}, group_id="g", group_size=2) for i in range(2)])
    readers = [q.reader("trainer", ["x"], GroupBatcher(1), replica=ReplicaSet("dp", r, 2)) for r in range(2)]
    batches = [r.get(timeout=10, lease_s=600.0) for r in readers]
    assert batches[0].lease_id == batches[1].lease_id and batches[1].lease_timeout_s == 600.0
    readers[1].ack_and_publish(batches[1], 1)
    assert (q.version, len(q)) == (0, 2)  # one rank of two: the rows are not consumed, the version waits
    readers[0].ack_and_publish(batches[0], 1)
    assert (q.version, len(q)) == (1, 0)
