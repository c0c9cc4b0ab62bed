"""Pipelined puts over Ray (``pipeline_puts=True``): read-your-writes, errors on the next call, copies."""

from __future__ import annotations

import random
import sys
from typing import Any

import pytest

from relax_queue import (
    Capacity,
    FixedSizeBatcher,
    QueueConfig,
    QueueFullError,
    RowInput,
    TaskSpec,
    TransferQueue,
    create_ray_queue,
)

pytestmark = pytest.mark.integration
np = pytest.importorskip("numpy")


@pytest.fixture
def ray(ray_session: Any) -> Any:
    ray_session.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return ray_session


def test_each_get_sees_the_put_its_client_made_just_before(ray: Any) -> None:
    """Random puts (all three forms) each followed by a get of exactly the rows put: the keys and values
    delivered equal the in-process queue's for the same calls, two actor calls an op. The gets do not wait
    (``timeout=0``): each finds its rows only because the actor serves it after the put; rows of 64 KiB
    go through the object store, and the actor's adoption of them awaits, letting other calls run."""
    config = QueueConfig(tasks=(TaskSpec("t"),))
    client = create_ray_queue("pipe-order", config, pipeline_puts=True)
    local = TransferQueue(config)
    try:
        rng = random.Random(3)
        key, held, local_held = 0, None, None
        for _ in range(40):
            n = rng.choice((1, 3, 20))
            keys = list(range(key, key + n))
            key += n
            form = rng.choice(("put", "put_many", "put_columns"))
            width = rng.choice((4, 20_000))  # 80 kB rows: adopted from the object store, as a durable queue does
            values = np.arange(n * width, dtype=np.float32).reshape(n, width) + keys[0]
            for queue in (client, local):
                if form == "put" and n == 1:
                    queue.put(keys[0], {"x": values[0]})
                elif form == "put_columns":
                    queue.put_columns(keys, {"x": values})
                else:
                    queue.put_many([RowInput(k, {"x": values[i]}) for i, k in enumerate(keys)])
            trips = client.round_trips
            held = client.reader("t", ["x"], FixedSizeBatcher(n)).get_columns(timeout=0, ack=held)
            assert client.round_trips - trips == 1  # the get alone: the put before it was one call
            local_held = local.reader("t", ["x"], FixedSizeBatcher(n)).get_columns(timeout=0, ack=local_held)
            assert held.keys == local_held.keys == keys
            np.testing.assert_array_equal(np.asarray(held.column("x")), np.asarray(local_held.column("x")))
        trips = client.round_trips
        client.flush()  # nothing in flight after a get: no call
        assert client.round_trips == trips
    finally:
        client.shutdown()


def test_a_failed_put_raises_on_the_next_call_which_is_not_made(ray: Any) -> None:
    config = QueueConfig(tasks=(TaskSpec("t"),), capacity=Capacity(max_rows=1))
    client = create_ray_queue("pipe-errors", config, pipeline_puts=True)
    try:
        client.put(1, {"x": 1})
        client.put(2, {"x": 2}, timeout=0)  # the queue is full: refused on the actor, returns here
        reader = client.reader("t", ["x"])
        with pytest.raises(QueueFullError):
            reader.get(timeout=30)  # the put's error; the get leased nothing
        metrics = client.metrics()
        assert metrics["depth_rows"] == 1 and metrics["tasks"]["t"]["leased"] == 0
        assert metrics["tasks"]["t"]["delivered"] == 0
        client.put(3, {"x": 3}, timeout=0)
        trips = client.round_trips
        with pytest.raises(QueueFullError):
            client.publish_version(5)  # not made: the put's error instead
        assert client.round_trips == trips  # waiting for the put in flight is no call
        assert client.version == 0
        batch = reader.get(timeout=30)
        assert [row.key for row in batch.rows] == [1]
        client.put(4, {"x": 4}, timeout=0)
        with pytest.raises(QueueFullError):
            client.flush()  # the row of key 1 is leased, not acked: still full
        reader.ack(batch)
        client.put(5, {"x": 5}, timeout=0)
        client.flush()
        assert [row.key for row in reader.get(timeout=30).rows] == [5]
    finally:
        client.shutdown()


def test_a_copy_of_a_client_pipelines_its_own_puts(ray: Any) -> None:
    """Clients pickled into producer tasks number their puts apart; each flushes before it returns."""
    client = create_ray_queue("pipe-copies", QueueConfig(tasks=(TaskSpec("t"),)), pipeline_puts=True)

    @ray.remote(num_cpus=0)
    def produce(queue: Any, pid: int, n: int) -> int:
        for i in range(n):
            queue.put((pid, i), {"x": np.full(3, i)})
        queue.flush()
        return queue.round_trips

    try:
        client.put(("driver", 0), {"x": np.zeros(3)})  # in flight while the client is pickled
        base = client.round_trips
        trips = ray.get([produce.remote(client, pid, 20) for pid in range(3)], timeout=120)
        assert trips == [base + 20] * 3  # each copy made its 20 puts, nothing of the driver's in flight
        batch = client.reader("t", ["x"], FixedSizeBatcher(61)).get_columns(timeout=30)
        assert sorted(batch.keys, key=str) == sorted(
            [("driver", 0)] + [(pid, i) for pid in range(3) for i in range(20)], key=str
        )
    finally:
        client.shutdown()
