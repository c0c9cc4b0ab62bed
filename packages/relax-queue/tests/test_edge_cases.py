"""Edge cases of the public in-process API: validation, partial failures, closing, leases of re-put keys."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from relax_queue import (
    ArgumentError,
    BoundedStaleness,
    ConfigError,
    FieldTypeError,
    GroupBatcher,
    GroupDeadlockError,
    GroupError,
    QueueClosedError,
    QueueConfig,
    QueueFullError,
    QueueTimeoutError,
    RowInput,
    TaskSpec,
    TransferQueue,
)

MakeQueue = Callable[..., TransferQueue]


# ------------------------------------------------------------------ versions
@pytest.mark.parametrize(
    "put",
    [
        lambda q: q.put("k", {"x": 1}, versions=-1),
        lambda q: q.put("k", {"x": 1}, versions=(-1, 0)),
        lambda q: q.put_many([RowInput("k", {"x": 1}, versions=-2)]),
        lambda q: q.put_columns(["k"], {"x": [1]}, v_min=-1),
        lambda q: q.put_columns(["k"], {"x": [1]}, v_min=np.array([-1])),
        lambda q: q.put("k", {"x": 1}, versions=1.0),
        lambda q: q.put("k", {"x": 1}, versions=True),
    ],
)
def test_every_put_form_rejects_a_negative_or_non_int_version(make_queue: MakeQueue, put: Any) -> None:
    q = make_queue(tasks=("a",))
    with pytest.raises(FieldTypeError, match=r"versions|v_min"):
        put(q)
    assert len(q) == 0


def test_a_re_put_with_a_negative_version_is_rejected_too(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a",))
    q.put("k", {"x": 1}, versions=2)
    with pytest.raises(FieldTypeError, match="versions"):
        q.put("k", {"y": 1}, versions=-1)
    assert q.reader("a").get(1, timeout=0).rows[0].fields == {"x": 1}


def test_numpy_integer_versions_are_ints_in_every_put_form(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a",))
    q.put("p", {"x": 1}, versions=np.int64(3))
    q.put_many([RowInput("m", {"x": 1}, versions=(np.int32(2), np.int64(4)))])
    q.put_columns(["c"], {"x": [1]}, v_min=np.int64(5), v_max=[np.int16(6)])
    rows = q.reader("a").get(3, timeout=0).rows
    assert [(r.key, r.v_min, r.v_max) for r in rows] == [("p", 3, 3), ("m", 2, 4), ("c", 5, 6)]
    assert all(type(r.v_min) is int and type(r.v_max) is int for r in rows)


def test_a_re_put_that_contradicts_the_stored_row_is_counted_and_the_first_put_wins(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a",))
    q.put("k", {"x": 1}, versions=(3, 4), group_id="g", group_size=2)
    q.put("k", {"y": 2})  # gives nothing to contradict: a later stage adding its field
    q.put("k", {"z": 3}, versions=(3, 4), group_id="g", group_size=2)  # the same row again
    assert q.metrics()["conflicting_puts"] == 0
    q.put("k", {"w": 4}, versions=7)
    q.put_columns(["k"], {"v": [5]}, v_min=3, v_max=4, group_ids=["h"], group_sizes=2)
    assert q.metrics()["conflicting_puts"] == 2
    q.put("k2", {"x": 1}, versions=(3, 4), group_id="g", group_size=2)
    row = next(r for r in q.reader("a", batcher=GroupBatcher(1)).get(timeout=0).rows if r.key == "k")
    assert (row.v_min, row.v_max, row.group_id, row.group_size) == (3, 4, "g", 2)
    assert row.fields == {"x": 1, "y": 2, "z": 3, "w": 4, "v": 5}


# ------------------------------------------------------------------ get(n)
@pytest.mark.parametrize("n", [0, -1, 2.5, True, "2"])
@pytest.mark.parametrize("grouped", [False, True])
def test_get_rejects_a_batch_size_that_is_not_a_positive_int(make_queue: MakeQueue, n: Any, grouped: bool) -> None:
    q = make_queue(tasks=("a",))
    if grouped:
        q.put_many([RowInput(i, {"x": i}, group_id="g", group_size=2) for i in range(2)])
        reader = q.reader("a", ["x"], GroupBatcher(1))
    else:
        q.put_many([RowInput(i, {"x": i}) for i in range(3)])
        reader = q.reader("a", ["x"])
    for get in (reader.get, reader.get_columns):
        with pytest.raises(ArgumentError, match=f"n must be None .* or an int >= 1, got {n!r}"):
            get(n, timeout=0)
    assert q.metrics()["tasks"]["a"]["leased"] == 0


# ------------------------------------------------------------------ partial failures wake readers
def _blocked_reader(q: TransferQueue, fields: list[str]) -> tuple[threading.Thread, list[Any]]:
    """A reader thread blocked in a get without timeout (it is waiting on the queue when this returns)."""
    got: list[Any] = []

    def read() -> None:
        try:
            got.append(q.reader("a", fields).get(1, timeout=None).keys)
        except QueueClosedError as err:
            got.append(err)

    thread = threading.Thread(target=read)
    thread.start()
    while True:  # wait until it sleeps on the condition, so only a wake-up can deliver the row
        with q._core.lock:
            if q._core.waiting:
                break
    return thread, got


@pytest.mark.parametrize(
    "failing_call",
    [
        lambda q: q.put_many([RowInput("k", {"x": 1}), RowInput("bad", {1: "not a str name"})]),
        lambda q: q.put_many([RowInput("k2", {"x": 1}), RowInput("bad", {1: "not a str name"})]),
        lambda q: q.put_columns(["k2", "j"], {"x": [1, 2]}, group_ids=[None, "g"], group_sizes=[None, 0]),
        lambda q: q.add_fields_many({"k": {"x": 1}, "other": {1: "not a str name"}}),
    ],
)
def test_a_call_failing_part_way_wakes_readers_for_what_it_stored(make_queue: MakeQueue, failing_call: Any) -> None:
    q = make_queue(tasks=("a",))
    q.put("k", {"y": 0})  # some cases complete this row, others add row k2
    thread, got = _blocked_reader(q, ["x"])
    with pytest.raises((FieldTypeError, GroupError)):
        failing_call(q)
    thread.join(timeout=60)  # woken, it returns at once; a generous bound for a loaded machine
    woken = not thread.is_alive()
    q.close()  # releases a reader that was never woken
    thread.join()
    assert woken and len(got) == 1 and got[0] in (["k"], ["k2"])


# ------------------------------------------------------------------ leases follow the stored row
def _requeue_while_leased() -> TransferQueue:
    """Key ``k`` is leased to task ``a``, requeued as stale by the trainer, and put again."""
    q = TransferQueue(
        QueueConfig(
            tasks=(TaskSpec("a"), TaskSpec("trainer", check_staleness=True)),
            staleness=BoundedStaleness(tau=0, on_stale="requeue"),
        )
    )
    q.put("k", {"x": "old"}, versions=0)
    q.reader("a").get(1, timeout=0)  # held, never settled
    q.publish_version(1)
    with pytest.raises(QueueTimeoutError):
        q.reader("trainer").get(1, timeout=0)  # finds k stale: requeued
    assert [r.key for r in q.take_requeued()] == ["k"]
    q.put("k", {"x": "new"}, versions=1)
    return q


def test_a_lease_on_a_requeued_row_does_not_count_for_the_row_put_again_under_its_key() -> None:
    q = _requeue_while_leased()
    assert q.metrics()["tasks"]["a"]["leased"] == 0  # the leased row is gone
    restored = TransferQueue(q.config)
    restored.load_state_dict(q.state_dict())
    row = restored.reader("a").get(1, timeout=0).rows[0]
    assert (row.fields, row.deliveries) == ({"x": "new"}, 1)
    assert restored.metrics()["redeliveries"] == 0


def test_acking_a_lease_whose_row_was_requeued_counts_no_acked_row() -> None:
    q = _requeue_while_leased()
    first = q.metrics()["tasks"]["a"]
    lease_id = next(iter(q._core.leases))
    q.ack(lease_id)
    assert q.metrics()["tasks"]["a"]["acked"] == first["acked"] == 0
    assert q.reader("a").get(1, timeout=0).rows[0].fields == {"x": "new"}  # the new row is still to deliver


# ------------------------------------------------------------------ closing
MUTATIONS: dict[str, Callable[[TransferQueue, Any], Any]] = {
    "put": lambda q, b: q.put("new", {"x": 1}),
    "put_many": lambda q, b: q.put_many([RowInput("new", {"x": 1})]),
    "put_columns": lambda q, b: q.put_columns(["new"], {"x": [1]}),
    "add_fields": lambda q, b: q.add_fields("k", {"y": 1}),
    "add_fields_many": lambda q, b: q.add_fields_many({"k": {"y": 1}}),
    "get": lambda q, b: q.reader("a").get(1, timeout=0),
    "get_columns": lambda q, b: q.reader("a").get_columns(1, timeout=0),
    "ack": lambda q, b: q.ack(b),
    "nack": lambda q, b: q.nack(b),
    "renew": lambda q, b: q.renew(b),
    "admit": lambda q, b: q.admit(1),
    "release_admission": lambda q, b: q.release_admission(0),
    "refund_admission": lambda q, b: q.refund_admission(0),
    "publish_version": lambda q, b: q.publish_version(5),
    "ack_and_publish": lambda q, b: q.ack_and_publish(b, 5),
    "take_requeued": lambda q, b: q.take_requeued(),
    "load_state_dict": lambda q, b: q.load_state_dict(q.state_dict()),
}


@pytest.mark.parametrize("call", sorted(MUTATIONS))
def test_after_close_every_call_that_changes_the_queue_raises(make_queue: MakeQueue, call: str) -> None:
    q = make_queue(tasks=("a",))
    q.put_many([RowInput("k", {"x": 1}), RowInput("j", {"x": 2})])
    batch = q.reader("a").get(1, timeout=0)
    before = q.state_dict()
    q.close()
    with pytest.raises(QueueClosedError, match="closed"):
        MUTATIONS[call](q, batch)
    assert q.state_dict() == before


def test_after_close_reads_and_snapshots_still_work(make_queue: MakeQueue, tmp_path: Any) -> None:
    q = make_queue(tasks=("a",))
    q.put_many([RowInput("k", {"x": 1}), RowInput("j", {"x": 2})])
    q.reader("a").get(1, timeout=0)
    q.close()
    assert (len(q), q.ready("a"), q.version, q.metrics()["tasks"]["a"]["leased"]) == (2, 1, 0, 1)
    q.save(tmp_path / "q.pkl")
    restored = make_queue(tasks=("a",))
    restored.load(tmp_path / "q.pkl")
    assert sorted(restored.reader("a").get(2, timeout=0).keys) == ["j", "k"]  # the leased row comes back


# ------------------------------------------------------------------ add_fields, snapshots, QueueFullError
def test_add_fields_validates_field_names_whether_or_not_the_key_is_stored(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a",))
    with pytest.raises(FieldTypeError, match="field names must be str"):
        q.add_fields("unknown", {1: "x"})
    with pytest.raises(FieldTypeError, match="mapping"):
        q.add_fields_many({"unknown": [("x", 1)]})  # type: ignore[dict-item]
    assert q.metrics()["add_fields_unknown_key"] == 0


def test_loading_a_snapshot_larger_than_the_queue_is_refused_and_changes_nothing(make_queue: MakeQueue) -> None:
    big = make_queue(tasks=("a",), max_rows=10)
    big.put_many([RowInput(i, {"x": b"12345678"}) for i in range(5)])
    small = make_queue(tasks=("a",), max_rows=4)
    small.put("mine", {"x": 1})
    with pytest.raises(ConfigError, match=r"5 rows, more than this queue's capacity\.max_rows=4"):
        small.load_state_dict(big.state_dict())
    by_bytes = make_queue(tasks=("a",), max_rows=None, max_bytes=7)  # each of the snapshot's rows holds 8 bytes
    with pytest.raises(ConfigError, match=r"row 0 is 8 bytes, more than this queue's capacity\.max_bytes=7"):
        by_bytes.load_state_dict(big.state_dict())
    assert small.reader("a").get(1, timeout=0).keys == ["mine"]


def test_queue_full_error_lists_only_the_rows_it_stored(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a",), max_rows=2)
    q.put("known", {"x": 1})
    with pytest.raises(QueueFullError) as err:
        q.put_many([RowInput("known", {"y": 2}), RowInput("new", {"x": 3}), RowInput("late", {"x": 4})], timeout=0)
    assert err.value.inserted == ["new"]  # "known" was only given a field
    one = make_queue(tasks=("a",), max_rows=1)
    one.put("known", {"x": 1})
    with pytest.raises(QueueFullError) as err:
        one.put_columns(["known", "new"], {"y": [1, 2]}, timeout=0)
    assert err.value.inserted == []


# ------------------------------------------------------------------ group deadlock
def test_a_queue_full_of_incomplete_groups_is_reported_as_a_deadlock_at_once(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a",), max_rows=4)
    q.put_many([RowInput(f"{g}{i}", {"x": i}, group_id=g, group_size=3) for g in "ab" for i in range(2)])
    with pytest.raises(GroupDeadlockError, match=r"all 4 stored rows belong to 2 incomplete groups \('a', 'b'\)"):
        q.put("a2", {"x": 2}, group_id="a", group_size=3, timeout=None)  # would wait forever
    with pytest.raises(QueueFullError):  # a GroupDeadlockError is a QueueFullError
        q.put_columns(["b2"], {"x": [2]}, group_ids=["b"], group_sizes=3)
    with pytest.raises(QueueTimeoutError, match="group deadlock"):
        q.reader("a", batcher=GroupBatcher(1)).get(timeout=0)


def test_a_full_queue_with_a_complete_group_or_an_ungrouped_row_is_no_deadlock(make_queue: MakeQueue) -> None:
    for last in (RowInput("a1", {"x": 1}, group_id="a", group_size=2), RowInput("u", {"x": 1})):
        q = make_queue(tasks=("a",), max_rows=3)
        q.put_many(
            [
                RowInput("a0", {"x": 0}, group_id="a", group_size=2),
                RowInput("b0", {"x": 0}, group_id="b", group_size=2),
                last,
            ]
        )
        with pytest.raises(QueueFullError) as err:
            q.put("c0", {"x": 0}, group_id="c", group_size=2, timeout=0)
        assert type(err.value) is QueueFullError  # waiting can help: a reader can free room


def test_a_group_larger_than_max_rows_is_refused(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a",), max_rows=2)
    with pytest.raises(GroupError, match="group_size=3 can never be complete in a queue of max_rows=2"):
        q.put("k", {"x": 1}, group_id="g", group_size=3)
