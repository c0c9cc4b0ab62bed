"""Array columns are stored as one segment per put and delivered as slices of it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from relax_queue import Capacity, FixedSizeBatcher, QueueConfig, TaskSpec, TransferQueue

MakeQueue = Callable[..., TransferQueue]


def _columns(start: int, n: int) -> dict[str, np.ndarray]:
    ids = np.arange(start, start + n)
    return {"obs": np.stack([ids, ids * 10]).T.astype(np.float32), "act": ids.astype(np.int64)}


def test_rows_of_one_put_come_back_as_a_slice_of_the_array_put() -> None:
    q = TransferQueue(QueueConfig(tasks=("a",)))
    cols = _columns(0, 6)
    q.put_columns(list(range(6)), cols)
    reader = q.reader("a", ["obs", "act"], FixedSizeBatcher(4))
    batch = reader.get_columns(timeout=0)
    assert isinstance(batch.columns["obs"], np.ndarray) and batch.columns["obs"].shape == (4, 2)
    assert np.shares_memory(batch.columns["obs"], cols["obs"])  # a view of the array put, not a restack
    np.testing.assert_array_equal(batch.columns["obs"], [[0, 0], [1, 10], [2, 20], [3, 30]])
    np.testing.assert_array_equal(batch.columns["act"], [0, 1, 2, 3])
    rows = q.reader("a", ["obs", "act"]).get(2, timeout=0).rows  # the row API sees row views
    assert [r.key for r in rows] == [4, 5]
    np.testing.assert_array_equal(rows[1].fields["obs"], [5, 50])
    assert rows[1].fields["act"] == 5


def test_rows_from_several_puts_or_out_of_order_come_back_one_value_per_row() -> None:
    q = TransferQueue(QueueConfig(tasks=("a",)))
    q.put_columns([0, 1, 2], _columns(0, 3))
    q.put_columns([3, 4], _columns(3, 2))
    reader = q.reader("a", ["act"], FixedSizeBatcher(2))
    first = reader.get_columns(timeout=0)  # rows 0, 1
    reader.nack(first)  # redelivered first, then row 2 (the same put, consecutive again)
    again = reader.get_columns(3, timeout=0)
    assert again.keys == [0, 1, 2] and isinstance(again.columns["act"], np.ndarray)
    mixed = reader.get_columns(2, timeout=0, ack=again)  # rows 3, 4 of the second put: a slice
    np.testing.assert_array_equal(mixed.columns["act"], [3, 4])
    q.put_columns([5], _columns(5, 1))
    q.put_columns([6], {"act": [6], "obs": [np.zeros(2, np.float32)]})  # a list column: per-row values
    tail = reader.get_columns(2, timeout=0, ack=mixed)
    assert tail.keys == [5, 6] and [int(v) for v in tail.columns["act"]] == [5, 6]


def test_fields_added_later_and_snapshots_see_row_values(tmp_path: object) -> None:
    q = TransferQueue(QueueConfig(tasks=("a",)))
    q.put_columns(["x", "y"], _columns(0, 2))
    q.add_fields_many({"x": {"reward": 1.0}, "y": {"reward": 2.0}})
    state = q.state_dict()
    np.testing.assert_array_equal(state["rows"][1]["fields"]["obs"], [1, 10])
    restored = TransferQueue(q.config)
    restored.load_state_dict(state)
    batch = restored.reader("a", ["obs", "act", "reward"], FixedSizeBatcher(2)).get_columns(timeout=0)
    np.testing.assert_array_equal(np.asarray(batch.columns["obs"]), [[0, 0], [1, 10]])
    assert batch.columns["reward"] == [1.0, 2.0]


@pytest.mark.parametrize("max_bytes", [None, 10_000])
def test_an_array_column_is_sized_by_its_nbytes_when_bounded(max_bytes: int | None) -> None:
    q = TransferQueue(QueueConfig(tasks=(TaskSpec("a"),), capacity=Capacity(max_rows=None, max_bytes=max_bytes)))
    cols = _columns(0, 4)  # obs: 4 x 2 float32 = 32 bytes, act: 4 int64 = 32 bytes
    q.put_columns(list(range(4)), cols)
    assert q.metrics()["depth_bytes"] == 64
    q.reader("a", ["act"]).get(4, timeout=0)
    assert q._core.nbytes == (64 if max_bytes else 0)  # an unbounded queue keeps no running count
