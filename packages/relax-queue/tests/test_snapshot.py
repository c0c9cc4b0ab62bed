"""Snapshots: state_dict round trips, atomic save/load, leased rows redelivered after restore."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest

from relax_queue import ConfigError, LeaseError, QueueFullError, RowInput, TaskSpec, TransferQueue, snapshot_keys

MakeQueue = Callable[..., TransferQueue]


def _drain(q: TransferQueue, task: str) -> list[object]:
    keys: list[object] = []
    reader = q.reader(task)
    while q.metrics()["tasks"][task]["backlog"]:
        batch = reader.get(1, timeout=0)
        keys.extend(batch.keys)
        reader.ack(batch)
    return keys


def test_restore_redelivers_leased_rows_and_keeps_acked_ones_consumed(make_queue: MakeQueue, tmp_path: Path) -> None:
    q = make_queue(tasks=("a", "b"), tau=2, batch_size=2)
    q.admit(3)
    q.put_many([RowInput(i, {"x": i}, versions=1, tags={"n": i}) for i in range(5)], admitted=True)
    q.publish_version(2)
    ra = q.reader("a")
    acked = ra.get(2, timeout=0)
    ra.ack(acked)  # rows 0, 1 consumed by a
    leased = ra.get(1, timeout=0)  # row 2 leased by a, not acked
    rb = q.reader("b")
    rb.ack(rb.get(5, timeout=0))  # b consumed everything -> rows 0, 1 freed
    path = tmp_path / "snap" / "queue.pkl"
    q.save(path)
    assert not [p for p in path.parent.iterdir() if p.name != "queue.pkl"]  # no temp file left behind

    restored = make_queue(tasks=("a", "b"), tau=2, batch_size=2)
    restored.load(path)
    assert len(restored) == 3
    assert restored.version == 2
    r = restored.reader("a")
    first = r.get(1, timeout=0)
    assert first.keys == leased.keys  # the leased row comes back first
    assert first.rows[0].deliveries == 2
    assert first.rows[0].tags == {"n": 2}
    r.ack(first)
    assert _drain(restored, "a") == [3, 4]
    assert len(restored) == 0
    m = restored.metrics()
    assert m["redeliveries"] == 1
    assert m["admission"]["accepted"] == 5 and m["admission"]["running"] == 0  # running reset on restore
    with pytest.raises(LeaseError):
        restored.ack(leased)  # leases do not survive a restore
    restored.put(0, {"x": 0})  # consumed keys stay retired
    assert len(restored) == 0


def test_state_dict_is_plain_and_picklable_and_groups_survive(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a",))
    q.put_many([RowInput(f"g{i}", {"x": i}, group_id="g", group_size=3) for i in range(2)])
    state = pickle.loads(pickle.dumps(q.state_dict()))
    restored = make_queue(tasks=("a",))
    restored.load_state_dict(state)
    restored.put("g2", {"x": 2}, group_id="g", group_size=3)
    assert sorted(restored.reader("a").get(3, timeout=0).keys) == ["g0", "g1", "g2"]


def test_snapshot_of_other_tasks_is_rejected(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a", "b"))
    with pytest.raises(ConfigError, match=r"tasks \['b'\]"):
        make_queue(tasks=("a",)).load_state_dict(q.state_dict())
    with pytest.raises(ConfigError, match="not a relax_queue state"):
        q.load_state_dict({"format": "other"})


def test_new_task_after_restore_consumes_restored_rows(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a",))
    q.put("k", {"x": 1})
    restored = make_queue(tasks=("a", TaskSpec("b")))
    restored.load_state_dict(q.state_dict())
    assert restored.reader("b").get(1, timeout=0).keys == ["k"]


def test_save_is_atomic_when_writing_fails(make_queue: MakeQueue, tmp_path: Path) -> None:
    q = make_queue(tasks=("a",))
    q.put("k", {"x": 1})
    path = tmp_path / "queue.pkl"
    q.save(path)
    before = path.read_bytes()
    q.put("bad", {"x": lambda: None})  # lambdas do not pickle
    with pytest.raises((pickle.PicklingError, AttributeError)):
        q.save(path)
    assert path.read_bytes() == before  # the old snapshot is intact
    assert os.listdir(tmp_path) == ["queue.pkl"]


def test_snapshot_keys_lists_unconsumed_rows_without_building_a_queue(make_queue: MakeQueue, tmp_path: Path) -> None:
    q = make_queue(tasks=("a", "b"))
    q.put_many([RowInput(k, {"x": 1}) for k in ("k0", "k1", "k2")])
    assert sorted(_drain(q, "a")) == ["k0", "k1", "k2"]  # every row consumed by a, still held for b
    reader = q.reader("b")
    batch = reader.get(1, timeout=0)
    reader.ack(batch)  # consumed by both tasks: freed
    q.save(tmp_path / "q.snap")
    assert sorted(snapshot_keys(tmp_path / "q.snap")) == sorted({"k0", "k1", "k2"} - set(batch.keys))
    (tmp_path / "other").write_bytes(pickle.dumps({"format": "something else", "rows": []}))
    with pytest.raises(ConfigError, match="not a relax_queue snapshot"):
        snapshot_keys(tmp_path / "other")


def test_a_snapshot_over_the_byte_bound_by_added_fields_restores_with_the_same_config(
    make_queue: MakeQueue, tmp_path: Path
) -> None:
    """Rows admitted near ``max_bytes``, then widened by a stage's field (additions are never blocked): the
    snapshot holds more bytes than the bound, and the same run with the same config must resume from it."""
    q = make_queue(tasks=("a",), max_rows=None, max_bytes=100)
    q.put_many([RowInput(i, {"tokens": b"t" * 30}) for i in range(3)])  # 90 of 100 bytes: admitted
    for i in range(3):
        q.add_fields(i, {"logprobs": b"l" * 20})  # a later stage's field: 150 bytes held
    assert q.metrics()["depth_bytes"] == 150
    q.save(tmp_path / "q.snap")

    restored = make_queue(tasks=("a",), max_rows=None, max_bytes=100)
    restored.load(tmp_path / "q.snap")
    assert restored.metrics()["depth_bytes"] == 150 and len(restored) == 3
    with pytest.raises(QueueFullError):  # new rows wait until the depth is back under the bound, as before the save
        restored.put(3, {"tokens": b"t" * 30}, timeout=0)
    reader = restored.reader("a")
    batch = reader.get(3, timeout=0)
    assert sorted(batch.keys) == [0, 1, 2]  # type: ignore[type-var]
    assert batch.rows[0].fields["logprobs"] == b"l" * 20
    reader.ack(batch)
    restored.put(3, {"tokens": b"t" * 30}, timeout=0)  # room again
