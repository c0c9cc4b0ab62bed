"""Ray transport wire: one actor call per client call, and what travels comes back as the in-process queue gives it."""

from __future__ import annotations

import gc
import random
import sys
from collections.abc import Callable
from typing import Any

import pytest

from relax_queue import (
    FixedSizeBatcher,
    QueueConfig,
    RayQueueClient,
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


class _CountingHandle:
    """Stands in for the actor handle and counts the actor calls submitted through it."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.calls: list[str] = []

    def __getattr__(self, method: str) -> Any:
        target = getattr(self.handle, method)
        calls = self.calls

        class _Method:
            def remote(self, *args: Any, **kwargs: Any) -> Any:
                calls.append(method)
                return target.remote(*args, **kwargs)

        return _Method()


def test_every_client_call_is_one_actor_round_trip(ray: Any) -> None:
    client = create_ray_queue("trips", QueueConfig(tasks=(TaskSpec("t"),)))
    counting = _CountingHandle(client.actor)
    client.actor = counting
    try:
        reader = client.reader("t", ["x"], FixedSizeBatcher(2))
        held: list[Any] = [None]
        state = {"key": 0, "ready": 0, "version": 0}

        def put_rows(n: int) -> list[int]:
            state["key"] += n
            state["ready"] += n
            return list(range(state["key"] - n, state["key"]))

        def take() -> None:
            state["ready"] -= 2

        def publish() -> None:
            state["version"] += 1
            client.publish_version(state["version"])

        ops: dict[str, Callable[[], Any]] = {
            "put_columns": lambda: client.put_columns(put_rows(4), {"x": np.ones((4, 3))}),
            "put_many": lambda: client.put_many([RowInput(k, {"x": np.ones(3)}) for k in put_rows(3)]),
            "put": lambda: client.put(put_rows(1)[0], {"x": np.ones(3)}),
            "get_columns": lambda: (take(), held.__setitem__(0, reader.get_columns(timeout=10, ack=held[0]))),
            "get": lambda: (take(), held.__setitem__(0, reader.get(timeout=10, ack=held[0]))),
            "version": lambda: client.version,
            "publish_version": publish,
            "admit": lambda: client.admit(1),
            "ready": lambda: client.ready("t"),
            "metrics": client.metrics,
            "add_fields": lambda: client.add_fields(state["key"] - 1, {"y": 1}),
        }
        rng = random.Random(7)
        for _ in range(60):
            name = rng.choice(list(ops))
            if name.startswith("get") and state["ready"] < 2:
                name = "put_columns"  # a get must find a whole batch: it would wait otherwise
            before_calls, before_trips = len(counting.calls), client.round_trips
            ops[name]()
            assert len(counting.calls) - before_calls == 1, (name, counting.calls[before_calls:])
            assert client.round_trips - before_trips == 1, name
        assert client.round_trips == len(counting.calls) == 60
    finally:
        client.actor = counting.handle
        client.shutdown()


def _same_calls(queue: TransferQueue | RayQueueClient, ref: Any) -> list[Any]:
    """The same puts and gets on either queue; returns what the gets delivered."""
    big = np.arange(40_000, dtype=np.float64).reshape(1000, 40)  # 320 kB: passed beside the pickle
    keys = [(p, i) for p in range(2) for i in range(500)]
    columns = {
        "small": np.arange(1000, dtype=np.int32),  # pickled with the keys
        "big": big,
        "pairs": [(i, str(i)) for i in range(1000)],
        "path": [f"x-ray.{i}.png" for i in range(1000)],  # names look Ray's: the Ray-serialised way
        "nested": [{"ref": ref} if i == 3 else None for i in range(1000)],
    }
    queue.put_columns(keys, columns, v_min=[i % 3 for i in range(1000)], v_max=2, group_ids=None)
    queue.put_many([RowInput(("r", i), {"small": i, "big": np.full(10_000, i), "pairs": (i,)}) for i in range(3)])
    fields = ["small", "big", "pairs", "path", "nested"]
    cols = queue.reader("t", fields, FixedSizeBatcher(1000)).get_columns(timeout=10)
    rows = queue.reader("t", ["small", "big", "pairs"], FixedSizeBatcher(3)).get(timeout=10)
    return [cols, rows]


def test_columns_and_rows_through_ray_equal_the_in_process_queue(ray: Any) -> None:
    config = QueueConfig(tasks=(TaskSpec("t"),))
    ref = ray.put(41)
    local = _same_calls(TransferQueue(config), ref)
    client = create_ray_queue("wire-diff", config, object_store_threshold=4096)
    try:
        remote = _same_calls(client, ref)
        for mine, theirs in ((remote[0], local[0]),):
            assert mine.keys == theirs.keys and all(type(k) is tuple for k in mine.keys)
            assert (mine.v_min, mine.v_max, mine.deliveries) == (theirs.v_min, theirs.v_max, theirs.deliveries)
            assert list(mine.columns) == list(theirs.columns)
            for name in ("small", "big"):
                np.testing.assert_array_equal(np.asarray(mine.column(name)), np.asarray(theirs.column(name)))
            assert mine.column("pairs") == theirs.column("pairs") and mine.column("path") == theirs.column("path")
            assert mine.column("nested")[:3] == [None] * 3
        assert [r.key for r in remote[1].rows] == [r.key for r in local[1].rows] == [("r", i) for i in range(3)]
        for mine_row, their_row in zip(remote[1].rows, local[1].rows, strict=True):
            assert mine_row.fields["pairs"] == their_row.fields["pairs"]
            np.testing.assert_array_equal(mine_row.fields["big"], their_row.fields["big"])
        # A Ray reference inside a field value went through Ray's serialiser, so Ray kept its object alive.
        del ref
        gc.collect()
        assert ray.get(remote[0].column("nested")[3]["ref"], timeout=30) == 41
    finally:
        client.shutdown()


def test_a_column_plain_pickle_refuses_still_travels(ray: Any) -> None:
    client = create_ray_queue("wire-lambda", QueueConfig(tasks=(TaskSpec("t"),)))
    try:
        client.put_columns([1, 2], {"f": [lambda x: x + 1, lambda x: x * 10]})
        client.put(3, {"f": lambda x: x - 1})
        batch = client.reader("t", ["f"], FixedSizeBatcher(3)).get_columns(timeout=10)
        assert [f(5) for f in batch.column("f")] == [6, 50, 4]
    finally:
        client.shutdown()


def test_mid_size_array_columns_through_ray_in_pieces_equal_the_in_process_queue(ray: Any) -> None:
    """Batches of changing size: a get reserves return values for as many pieces as the task's previous
    reply had; when they are too few, the columns come whole. Every batch equals the in-process queue's."""
    config = QueueConfig(tasks=(TaskSpec("t"),))
    local, client = TransferQueue(config), create_ray_queue("wire-pieces", config)
    try:
        rng = np.random.default_rng(5)
        key, held, local_held = 0, None, None
        for n in (1000, 10, 1000, 3000, 1000, 1000):
            keys = list(range(key, key + n))
            key += n
            cols = {
                "obs": rng.random((n, 32), dtype=np.float32),
                "act": rng.random((n, 7)),
                "reward": rng.random(n, dtype=np.float32),
            }
            for queue in (client, local):
                queue.put_columns(keys, cols)
            trips = client.round_trips
            held = client.reader("t", list(cols), FixedSizeBatcher(n)).get_columns(timeout=30, ack=held)
            assert client.round_trips - trips == 1
            local_held = local.reader("t", list(cols), FixedSizeBatcher(n)).get_columns(timeout=0, ack=local_held)
            assert held.keys == local_held.keys == keys
            for name, column in cols.items():
                got = np.asarray(held.column(name))
                np.testing.assert_array_equal(got, np.asarray(local_held.column(name)))
                np.testing.assert_array_equal(got, column)
                assert got.dtype == column.dtype and got.shape == column.shape
        assert client._reply_slots["t"] > 1  # the last gets came in pieces
    finally:
        client.shutdown()
