"""Core guarantees of the in-process queue: fields, tasks, leases, capacity, errors."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from relax_queue import (
    Capacity,
    ConfigError,
    FieldTypeError,
    GroupError,
    LeaseError,
    QueueClosedError,
    QueueConfig,
    QueueFullError,
    QueueTimeoutError,
    RowInput,
    RowTooLargeError,
    TaskSpec,
    TransferQueue,
    UnknownTaskError,
)

MakeQueue = Callable[..., TransferQueue]


def test_reader_sees_only_rows_with_all_its_fields_and_only_those_fields(
    make_queue: MakeQueue,
) -> None:
    q = make_queue(tasks=("trainer",))
    q.put("k1", {"tokens": [1, 2]})
    q.put("k2", {"tokens": [3], "reward": 0.5})
    reader = q.reader("trainer", fields=["tokens", "reward"])
    assert (q.ready("trainer", ["tokens", "reward"]), q.ready("trainer", ["tokens"]), q.ready("trainer")) == (1, 2, 2)
    with pytest.raises(QueueTimeoutError):
        reader.get(2, timeout=0.01)  # only k2 is ready; a fixed batch of 2 waits
    batch = reader.get(1, timeout=0)
    assert batch.keys == ["k2"]
    assert batch.rows[0].fields == {"tokens": [3], "reward": 0.5}
    assert q.ready("trainer", ["tokens"]) == 1  # leased rows are not ready
    q.add_fields("k1", {"reward": 1.0, "extra": "x"})
    batch2 = reader.get(1, timeout=0)
    assert batch2.keys == ["k1"]
    assert batch2.rows[0].fields == {"tokens": [1, 2], "reward": 1.0}  # "extra" was not asked for


def test_every_task_sees_every_row_and_readers_of_one_task_share(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("reward", "trainer"))
    q.put_many([RowInput(i, {"x": i}) for i in range(6)])
    r1, r2 = q.reader("reward", ["x"]), q.reader("reward", ["x"])
    b1, b2 = r1.get(3, timeout=0), r2.get(3, timeout=0)
    assert sorted(b1.keys + b2.keys) == list(range(6))
    with pytest.raises(QueueTimeoutError):
        r1.get(1, timeout=0)
    trainer = q.reader("trainer", ["x"]).get(6, timeout=0)
    assert trainer.keys == list(range(6))


def test_ack_frees_row_only_after_every_task_and_never_redelivers(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a", "b"))
    q.put("k", {"x": 1})
    a, b = q.reader("a", ["x"]), q.reader("b", ["x"])
    batch = a.get(1, timeout=0)
    a.ack(batch)
    assert len(q) == 1  # task b has not consumed it
    with pytest.raises(QueueTimeoutError):
        a.get(1, timeout=0)
    b.ack(b.get(1, timeout=0))
    assert len(q) == 0
    assert q.metrics()["freed"] == 1
    q.put("k", {"x": 2})  # a late duplicate of a consumed key is ignored
    assert len(q) == 0
    assert q.metrics()["duplicate_puts"] == 1


def test_retired_keys_are_remembered_for_at_least_remember_retired_and_bounded() -> None:
    keep = 5
    q = TransferQueue(QueueConfig(tasks=(TaskSpec("a"),), remember_retired=keep))
    reader = q.reader("a", ["x"])
    consumed = 0
    for burst in (3, 1, 7, 2, 4, 6, 1):  # acks of many sizes, some larger than keep
        q.put_columns(range(consumed, consumed + burst), {"x": [0] * burst})
        reader.ack(reader.get_columns(burst, timeout=0))
        consumed += burst
        # The last `keep` consumed keys are still refused (a late duplicate is not delivered again) ...
        for key in range(max(0, consumed - keep), consumed):
            q.put(key, {"x": 1})
        assert len(q) == 0
        # ... and memory stays bounded: at most 2 * keep keys are remembered.
        assert len(q._core.retired) <= 2 * keep
    # Keys older than 2 * keep are forgotten: a put of one is a new row again.
    q.put(0, {"x": 2})
    assert [row.fields["x"] for row in reader.get(1, timeout=0)] == [2]


def test_put_is_idempotent_per_key_and_field(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a",))
    q.put("k", {"x": 1}, versions=(3, 4))
    q.put("k", {"x": 99, "y": 2}, versions=(7, 7))  # x stays, y is added, versions unchanged
    row = q.reader("a").get(1, timeout=0).rows[0]
    assert row.fields == {"x": 1, "y": 2}
    assert (row.v_min, row.v_max) == (3, 4)
    assert len(q) == 1


def test_nack_redelivers_first_and_counts(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a",))
    q.put_many([RowInput(i, {"x": i}) for i in range(4)])
    reader = q.reader("a", ["x"])
    first = reader.get(2, timeout=0)
    reader.nack(first)
    again = reader.get(2, timeout=0)
    assert again.keys == first.keys
    assert [r.deliveries for r in again.rows] == [2, 2]
    assert q.metrics()["redeliveries"] == 2
    with pytest.raises(LeaseError, match=str(first.lease_id)):
        reader.ack(first)  # the nacked lease is settled


def test_get_can_ack_the_previous_batch_first(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a",))
    q.put_many([RowInput(i, {"x": i}) for i in range(6)])
    reader = q.reader("a", ["x"])
    first = reader.get(2, timeout=0)
    second = reader.get_columns(2, timeout=0, ack=first)
    assert (second.keys, q.metrics()["tasks"]["a"]["acked"], len(q)) == ([2, 3], 2, 4)
    reader.nack(second)
    with pytest.raises(LeaseError, match=str(second.lease_id)):
        reader.get(2, timeout=0, ack=second)  # a settled lease: nothing is leased
    assert reader.get(2, timeout=0, ack=None).keys == [2, 3]
    with pytest.raises(QueueTimeoutError):
        reader.get(9, timeout=0, ack=reader.get(2, timeout=0))  # acked even when no batch comes
    assert (q.metrics()["tasks"]["a"]["acked"], len(q)) == (4, 2)


def test_lease_expiry_redelivers_and_renew_extends(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a",), lease_timeout_s=0.05)
    q.put_many([RowInput(i, {"x": i}) for i in range(2)])
    reader = q.reader("a", ["x"])
    held = reader.get(1, timeout=0)
    renewed = reader.get(1, timeout=0)
    reader.renew(renewed, 10.0)
    time.sleep(0.08)
    redelivered = reader.get(1, timeout=1.0)
    assert redelivered.keys == held.keys
    with pytest.raises(LeaseError):
        reader.ack(held)
    reader.ack(renewed)  # still valid thanks to the renewal
    assert q.metrics()["expired_leases"] == 1


def test_blocked_get_wakes_on_lease_expiry_without_other_calls(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a",), lease_timeout_s=0.1)
    q.put("k", {"x": 1})
    reader = q.reader("a")
    reader.get(1, timeout=0)  # never acked
    start = time.monotonic()
    batch = reader.get(1, timeout=2.0)
    assert batch.keys == ["k"]
    assert 0.05 < time.monotonic() - start < 1.0


def test_capacity_in_rows_blocks_then_times_out_with_clear_error(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a",), max_rows=2)
    q.put_many([RowInput(i, {"x": i}) for i in range(2)])
    with pytest.raises(QueueFullError, match=r"rows 2/2") as info:
        q.put_many([RowInput(2, {"x": 2}), RowInput(3, {"x": 3})], timeout=0.05)
    assert info.value.inserted == []
    assert len(q) == 2


def test_capacity_in_bytes_and_backpressure_released_by_ack(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a",), max_rows=None, max_bytes=250)
    q.put("k0", {"blob": b"x" * 100})
    q.put("k1", {"blob": b"x" * 100})
    assert q.metrics()["depth_bytes"] == 200
    with pytest.raises(RowTooLargeError, match=r"251 bytes, .*its largest field is 'blob' \(251 bytes\)"):
        q.put("big", {"blob": b"x" * 251})
    done = threading.Event()

    def producer() -> None:
        q.put("k2", {"blob": b"x" * 100}, timeout=5.0)
        done.set()

    thread = threading.Thread(target=producer)
    thread.start()
    time.sleep(0.05)
    assert not done.is_set()  # blocked: 200 + 100 > 250
    reader = q.reader("a")
    reader.ack(reader.get(1, timeout=0))
    thread.join(timeout=5.0)
    assert done.is_set()
    assert q.metrics()["depth_bytes"] == 200
    assert q.metrics()["put_waits"] == 1


def test_errors_name_what_was_wrong_and_queue_keeps_serving(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a",))
    with pytest.raises(UnknownTaskError, match=r"'nope'.*registered tasks are \['a'\]"):
        q.reader("nope")
    with pytest.raises(FieldTypeError, match="field names must be str"):
        q.put("k", {1: "x"})  # type: ignore[dict-item]
    with pytest.raises(FieldTypeError, match="fields must be a mapping"):
        q.put("k", [1, 2])  # type: ignore[arg-type]
    with pytest.raises(FieldTypeError, match="versions"):
        q.put("k", {"x": 1}, versions=(3, 1))
    with pytest.raises(GroupError, match="without group_id"):
        q.put("k", {"x": 1}, group_size=2)
    with pytest.raises(FieldTypeError, match="list of names"):
        q.reader("a", fields="tokens")
    with pytest.raises(LeaseError, match="lease 12345"):
        q.ack(12345)
    q.put("ok", {"x": 1})
    assert q.reader("a").get(1, timeout=0).keys == ["ok"]


def test_group_validation(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a",))
    q.put("g0", {"x": 0}, group_id="p", group_size=2)
    with pytest.raises(GroupError, match="group_size=2, this row says 3"):
        q.put("g1", {"x": 1}, group_id="p", group_size=3)
    q.put("g1", {"x": 1}, group_id="p", group_size=2)
    with pytest.raises(GroupError, match="already has its 2 rows"):
        q.put("g2", {"x": 2}, group_id="p", group_size=2)


def test_config_validation_names_the_field(make_queue: MakeQueue) -> None:
    with pytest.raises(ConfigError, match=r"Capacity\.max_rows"):
        Capacity(max_rows=0)
    with pytest.raises(ConfigError, match="duplicate task names"):
        QueueConfig(tasks=("a", "a"))
    with pytest.raises(ConfigError, match="lease_timeout_s"):
        QueueConfig(tasks=(TaskSpec("a"),), lease_timeout_s=0)
    with pytest.raises(TypeError, match="not both"):
        TransferQueue(QueueConfig(), tasks=("a",))


def test_close_wakes_blocked_getters(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a",))
    errors: list[BaseException] = []

    def getter() -> None:
        try:
            q.reader("a").get(1, timeout=5.0)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=getter)
    thread.start()
    time.sleep(0.05)
    q.close()
    thread.join(timeout=2.0)
    assert len(errors) == 1 and isinstance(errors[0], QueueClosedError)


def test_threads_exact_accounting(make_queue: MakeQueue) -> None:
    """4 producer and 4 consumer threads per task: every key consumed exactly once by each task."""
    q = make_queue(tasks=("a", "b"), max_rows=16)
    n_producers, per_producer = 4, 250
    seen: dict[str, list[object]] = {"a": [], "b": []}
    lock = threading.Lock()

    def produce(p: int) -> None:
        for i in range(0, per_producer, 10):
            q.put_many([RowInput((p, j), {"x": j}) for j in range(i, i + 10)], timeout=10)

    def consume(task: str) -> None:
        reader = q.reader(task, ["x"])
        while True:
            try:
                batch = reader.get(7, timeout=0.3)
            except QueueTimeoutError:
                try:
                    batch = q.get(task, fields=("x",), n=1, timeout=0.3)
                except QueueTimeoutError:
                    return
            with lock:
                seen[task].extend(batch.keys)
            reader.ack(batch)

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(n_producers)]
    threads += [threading.Thread(target=consume, args=(t,)) for t in ("a", "b") for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    expected = sorted((p, j) for p in range(n_producers) for j in range(per_producer))
    for task in ("a", "b"):
        assert sorted(seen[task]) == expected  # type: ignore[type-var]
    assert len(q) == 0
    assert q.metrics()["depth_bytes"] == 0


def test_a_field_added_past_the_byte_bound_is_refused_naming_it(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a",), max_rows=None, max_bytes=250)
    q.put("k0", {"blob": b"x" * 100})
    assert q.add_fields("k0", {"score": 1.0})  # 8 bytes: counted (108)
    assert q.metrics()["depth_bytes"] == 108
    with pytest.raises(
        RowTooLargeError,
        match=r"row 'k0': adding 150 bytes of fields to its 108 would make it larger than max_bytes=250; its largest "
        r"field is 'dist' \(142 bytes\)",
    ):
        q.add_fields("k0", {"dist": b"x" * 142, "note": 0})
    assert q.metrics()["depth_bytes"] == 108  # refused whole: neither field was added
    reader = q.reader("a")
    [row] = reader.get(1, timeout=0).rows
    assert set(row.fields) == {"blob", "score"}
