"""The columnar path (put_columns / get_columns) against the per-row path (put_many / get) as reference.

Two queues with one configuration take the same random workload, one through each API; every
delivery (keys, fields, versions, groups, tags, staleness, flags, delivery counts), every error,
the requeued rows and the metrics must agree after every step.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import pytest

from relax_queue import (
    AsyncTransferQueue,
    Batch,
    Batcher,
    BoundedStaleness,
    Capacity,
    ColumnBatch,
    FieldTypeError,
    FixedSizeBatcher,
    GroupBatcher,
    GroupError,
    QueueConfig,
    QueueFullError,
    QueueTimeoutError,
    RelaxQueueError,
    ReplicaSet,
    RowInput,
    TaskSpec,
    TokenBudgetBatcher,
    TransferQueue,
    UnknownTaskError,
)

MakeQueue = Callable[..., TransferQueue]
Delivered = list[tuple[Any, ...]]


def _rows_of(batch: Batch) -> Delivered:
    return [
        (r.key, r.fields, r.v_min, r.v_max, r.group_id, r.group_size, dict(r.tags), r.staleness, r.stale, r.deliveries)
        for r in batch.rows
    ]


def _columns_of(batch: ColumnBatch) -> Delivered:
    """The same tuples read straight from the columns (not through ``to_batch``)."""
    names = list(batch.columns)
    return [
        (
            key,
            {name: batch.columns[name][i] for name in names},
            batch.v_min[i],
            batch.v_max[i],
            batch.group_ids[i],
            batch.group_sizes[i],
            dict(batch.tags[i]),
            batch.staleness[i],
            batch.stale[i],
            batch.deliveries[i],
        )
        for i, key in enumerate(batch.keys)
    ]


def _metrics(q: TransferQueue) -> dict[str, Any]:
    m = q.metrics()
    for name in ("put_latency", "get_latency"):
        m.pop(name)
    return m


class Pair:
    """The reference queue (per-row API) and the queue under test (columnar API), in step."""

    def __init__(self, config: QueueConfig) -> None:
        self.rows, self.cols = TransferQueue(config), TransferQueue(config)
        self.held: list[tuple[int, int]] = []  # lease ids (reference, columnar)

    def put(self, rows: list[RowInput], admitted: bool, timeout: float) -> None:
        """One put_many and the equivalent put_columns; the same rows stored or the same error."""
        outcome: list[Any] = []
        for put in (self._put_rows, self._put_columns):
            try:
                put(rows, admitted, timeout)
                outcome.append(None)
            except QueueFullError as err:
                outcome.append(("full", err.inserted))
            except RelaxQueueError as err:
                outcome.append((type(err).__name__, str(err)))
        assert outcome[0] == outcome[1]

    def _put_rows(self, rows: list[RowInput], admitted: bool, timeout: float) -> None:
        self.rows.put_many(rows, admitted=admitted, timeout=timeout)

    def _put_columns(self, rows: list[RowInput], admitted: bool, timeout: float) -> None:
        """put_columns of each run of rows with the same fields and tags (columns are rectangular)."""
        stored: list[Any] = []
        start = 0
        while start < len(rows):
            end = start + 1
            while end < len(rows) and (rows[end].fields.keys(), rows[end].tags.keys(), rows[end].versions is None) == (
                rows[start].fields.keys(),
                rows[start].tags.keys(),
                rows[start].versions is None,
            ):
                end += 1
            try:
                self._put_run(rows[start:end], admitted, timeout)
            except QueueFullError as err:
                raise QueueFullError(str(err), inserted=stored + err.inserted) from None
            stored += [r.key for r in rows[start:end]]
            start = end

    def _put_run(self, rows: list[RowInput], admitted: bool, timeout: float) -> None:
        names = list(rows[0].fields)
        versions = [r.versions if isinstance(r.versions, tuple) else (r.versions, r.versions) for r in rows]
        given = rows[0].versions is not None  # a run's rows all give versions or all leave them out
        tag_names = list(rows[0].tags)
        self.cols.put_columns(
            [r.key for r in rows],
            {name: [r.fields[name] for r in rows] for name in names},
            v_min=[v[0] for v in versions] if given else None,
            v_max=[v[1] for v in versions] if given else None,
            group_ids=[r.group_id for r in rows],
            group_sizes=[r.group_size for r in rows],
            tags={t: [r.tags[t] for r in rows] for t in tag_names} if tag_names else None,
            admitted=admitted,
            timeout=timeout,
        )

    def get(self, task: str, fields: tuple[str, ...], batcher: Batcher, n: int | None) -> tuple[int, int] | None:
        results: list[Any] = []
        for q, columnar in ((self.rows, False), (self.cols, True)):
            reader = q.reader(task, fields, batcher)
            try:
                results.append(reader.get_columns(n, timeout=0) if columnar else reader.get(n, timeout=0))
            except QueueTimeoutError:
                results.append(None)
            except RelaxQueueError as err:  # e.g. a token budget over rows without the tag
                results.append(f"{type(err).__name__}: {err}")
        by_rows, by_cols = results
        if isinstance(by_rows, str) or isinstance(by_cols, str):
            assert by_rows == by_cols
            return None
        if by_rows is None or by_cols is None:
            assert by_rows is by_cols is None, (by_rows, by_cols)
            return None
        assert isinstance(by_cols, ColumnBatch)
        assert _columns_of(by_cols) == _rows_of(by_rows)
        assert _rows_of(by_cols.to_batch()) == _rows_of(by_rows)
        assert (by_cols.task, by_cols.version, by_cols.lease_id) == (by_rows.task, by_rows.version, by_rows.lease_id)
        return by_rows.lease_id, by_cols.lease_id

    def check(self) -> None:
        assert _metrics(self.cols) == _metrics(self.rows)
        assert self.cols.admission_capacity() == self.rows.admission_capacity()
        assert self.cols.take_requeued() == self.rows.take_requeued()


def _random_rows(rng: random.Random, next_key: int, known: list[Any], version: int) -> tuple[list[RowInput], int]:
    """New ungrouped rows, a group (whole or part), known keys (field additions) or a row that does
    not fit its group (a new row, then one with a group size its group does not have)."""
    kind = rng.random()
    if kind < 0.45:
        count = rng.randint(1, 6)
        v = rng.randint(max(0, version - 3), version)
        fields = rng.choice([("x",), ("x", "y"), ("y",)])
        tags = {"num_tokens": rng.randint(1, 9)} if rng.random() < 0.5 else {}
        rows = [
            RowInput(k, {f: k for f in fields}, versions=(v, v + rng.randint(0, 1)), tags=tags)
            for k in range(next_key, next_key + count)
        ]
        if rng.random() < 0.1:  # a key twice in one call: the second adds nothing new
            rows.append(RowInput(next_key, {f: "again" for f in fields}, tags=tags))
        return rows, next_key + count
    if kind < 0.7:
        size = rng.randint(2, 4)
        v = rng.randint(max(0, version - 2), version)
        gid = f"g{next_key}"
        rows = [
            RowInput(k, {"x": k}, versions=v, group_id=gid, group_size=size, tags={"num_tokens": 2})
            for k in range(next_key, next_key + size)
        ]
        return rows[: rng.randint(1, size)], next_key + size
    if kind < 0.9 and known:
        picked = rng.sample(known, min(len(known), rng.randint(1, 3)))
        return [RowInput(k, {"x": -1, "y": -1}) for k in picked], next_key
    gid = f"g{next_key}"
    rows = [RowInput(next_key, {"x": 0}), RowInput(next_key + 1, {"x": 1}, group_id=gid, group_size=2)]
    rows.append(RowInput(next_key + 2, {"x": 2}, group_id=gid, group_size=3))
    return rows, next_key + 3


CONFIGS = {
    "flag": (BoundedStaleness(tau=1, on_stale="flag", batch_size=4), Capacity(max_rows=40)),
    "drop": (BoundedStaleness(tau=1, on_stale="drop", batch_size=4), Capacity(max_rows=40, max_bytes=600)),
    "requeue": (BoundedStaleness(tau=2, on_stale="requeue", batch_size=4), Capacity(max_rows=None)),
    "unbounded": (BoundedStaleness(), Capacity(max_rows=25)),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_columnar_path_matches_the_per_row_path_on_random_workloads(name: str, seed: int) -> None:
    rng = random.Random(f"{name}-{seed}")
    staleness, capacity = CONFIGS[name]
    config = QueueConfig(
        tasks=(TaskSpec("reward"), TaskSpec("trainer", check_staleness=True)),
        capacity=capacity,
        staleness=staleness,
        lease_timeout_s=3600.0,
        remember_retired=50,
    )
    pair = Pair(config)
    next_key, version = 0, 0
    batchers: list[Batcher] = [
        FixedSizeBatcher(3, partial=True),
        FixedSizeBatcher(2),
        GroupBatcher(2, partial=True),
        TokenBudgetBatcher(6, partial=True),
    ]
    for _ in range(250):
        op = rng.random()
        if op < 0.35:
            known = [r["key"] for r in pair.rows.state_dict()["rows"]]
            rows, next_key = _random_rows(rng, next_key, known + list(range(max(0, next_key - 5), next_key)), version)
            admitted = False
            if rng.random() < 0.3:
                granted = pair.rows.admit(len(rows))
                assert pair.cols.admit(len(rows)) == granted
                admitted = granted == len(rows)
                if not admitted:
                    pair.rows.release_admission(granted)
                    pair.cols.release_admission(granted)
            pair.put(rows, admitted=admitted, timeout=0)
        elif op < 0.42 and next_key:
            key = rng.randrange(next_key)
            assert pair.rows.add_fields(key, {"y": key}) == pair.cols.add_fields(key, {"y": key})
        elif op < 0.48:
            version += 1
            pair.rows.publish_version(version)
            pair.cols.publish_version(version)
        elif op < 0.62 and pair.held:
            ids = pair.held.pop(rng.randrange(len(pair.held)))
            action = rng.choice(["ack", "nack", "expire"])
            for q, lease_id in zip((pair.rows, pair.cols), ids, strict=True):
                if action == "expire":
                    q.renew(lease_id, -1.0)
                else:
                    getattr(q, action)(lease_id)
        elif op < 0.66:
            state_rows, state_cols = pair.rows.state_dict(), pair.cols.state_dict()
            assert state_cols == state_rows
            pair.rows, pair.cols = TransferQueue(config), TransferQueue(config)
            pair.rows.load_state_dict(state_rows)
            pair.cols.load_state_dict(state_cols)
            pair.held.clear()
        else:
            task = rng.choice(["reward", "trainer"])
            fields = rng.choice([("x",), ("x", "y")])
            ids = pair.get(task, fields, rng.choice(batchers), rng.choice([None, 1, 4]))
            if ids is not None:
                if rng.random() < 0.5:
                    pair.held.append(ids)
                else:
                    pair.rows.ack(ids[0])
                    pair.cols.ack(ids[1])
        pair.check()


def test_bad_columns_are_rejected_whole_with_the_argument_named(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a",))
    cases: list[tuple[dict[str, Any], str]] = [
        ({"keys": [1, 2], "columns": {"x": [1]}}, r"column 'x' has 1 values for 2 keys"),
        ({"keys": [1, 2], "columns": {"x": [1, 2], 3: [1, 2]}}, "field names must be str, got 3"),
        ({"keys": "ab", "columns": {"x": [1, 2]}}, "keys must be a sequence, got str"),
        ({"keys": [1, 2], "columns": [[1, 2]]}, "columns must map field name to values, got list"),
        ({"keys": [1, 2], "columns": {"x": 5}}, r"column 'x' must be a sequence, got int"),
        ({"keys": [1, 2], "columns": {"x": [1, 2]}, "v_min": [0, -1]}, r"v_min\[1\] \(key 2\) must be an int >= 0"),
        ({"keys": [1, 2], "columns": {"x": [1, 2]}, "v_min": [0]}, "v_min has 1 values for 2 keys"),
        ({"keys": [1, 2], "columns": {"x": [1, 2]}, "v_min": 1.5}, "v_min must be an int >= 0 or one per key"),
        (
            {"keys": [1, 2], "columns": {"x": [1, 2]}, "v_min": 3, "v_max": [3, 2]},
            r"row 1 \(key 2\) has v_min=3 > v_max=2",
        ),
        ({"keys": [1, 2], "columns": {"x": [1, 2]}, "group_ids": ["g"]}, "group_ids has 1 values for 2 keys"),
        ({"keys": [1, 2], "columns": {"x": [1, 2]}, "tags": {"n": [1]}}, r"tags column 'n' has 1 values for 2 keys"),
    ]
    for kwargs, message in cases:
        with pytest.raises(FieldTypeError, match=message):
            q.put_columns(**kwargs)
    with pytest.raises(GroupError, match="group_size=2 given without group_id"):
        q.put_columns([1], {"x": [1]}, group_sizes=2)
    assert len(q) == 0 and q.metrics()["puts"] == 0
    with pytest.raises(UnknownTaskError, match="unknown task 'nope'"):
        q.get_columns("nope", timeout=0)
    with pytest.raises(UnknownTaskError, match="nope"):
        q.reader("nope")


def test_put_columns_waits_for_capacity_and_reports_what_it_stored(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a",), max_rows=3)
    with pytest.raises(QueueFullError, match="3 of 4 rows were stored") as err:
        q.put_columns([0, 1, 2, 3], {"x": [0, 1, 2, 3]}, timeout=0.05)
    assert err.value.inserted == [0, 1, 2] and len(q) == 3
    reader = q.reader("a", ["x"])
    reader.ack(reader.get_columns(3, timeout=0))
    q.put_columns([0, 1, 2, 3], {"x": [0, 1, 2, 3]}, timeout=1)  # idempotent retry: only key 3 is new
    batch = reader.get_columns(1, timeout=0)
    assert batch.keys == [3] and batch.column("x") == [3]
    by_bytes = make_queue(tasks=("a",), max_rows=None, max_bytes=100)
    with pytest.raises(QueueFullError) as err:
        by_bytes.put_columns(["a", "b", "c"], {"x": [b"x" * 40, b"y" * 40, b"z" * 40]}, timeout=0)
    assert err.value.inserted == ["a", "b"] and by_bytes.metrics()["depth_bytes"] == 80


def test_fields_added_later_and_readers_see_complete_rows_only(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("reward", "trainer"))
    q.put_columns(["k0", "k1", "k2"], {"tokens": [[1], [2], [3]]}, v_min=[0, 1, 1], v_max=[1, 1, 2])
    q.put_columns(["k1", "k2"], {"reward": [1.0, 0.5], "tokens": [["ignored"], ["ignored"]]})  # adds only reward
    trainer = q.reader("trainer", ["tokens", "reward"], FixedSizeBatcher(5, partial=True))
    batch = trainer.get_columns(timeout=0)
    assert batch.keys == ["k1", "k2"]
    assert batch.columns == {"tokens": [[2], [3]], "reward": [1.0, 0.5]}
    assert (batch.v_min, batch.v_max, batch.deliveries) == ([1, 1], [1, 2], [1, 1])
    trainer.nack(batch)
    again = trainer.get_columns(timeout=0)
    assert again.keys == ["k1", "k2"] and again.deliveries == [2, 2]
    m = q.metrics()
    assert (m["fields_added"], m["duplicate_puts"], m["redeliveries"]) == (2, 0, 2)


def test_fields_none_delivers_every_field_or_refuses_mixed_rows_without_leasing(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a",))
    reader = q.reader("a", None, FixedSizeBatcher(2))
    q.put_columns([1, 2], {"x": [1, 2], "y": ["a", "b"]})
    assert reader.get_columns(timeout=0).columns == {"x": [1, 2], "y": ["a", "b"]}
    q.put_columns([3], {"x": [3]})
    q.put_columns([4], {"x": [4], "y": ["d"]})
    with pytest.raises(FieldTypeError, match="row 3 has \\['x'\\], row 4 has \\['x', 'y'\\]"):
        reader.get_columns(timeout=0)
    assert q.ready("a") == 2  # nothing was leased
    assert [r.fields for r in reader.get(timeout=0)] == [{"x": 3}, {"x": 4, "y": "d"}]


def test_the_callers_dicts_are_copied(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a",))
    fields, tags = {"x": 1}, {"n": 3}
    q.put("k", fields, tags=tags)
    q.add_fields("k", {"y": 2})
    tags["n"] = 99
    assert fields == {"x": 1}
    row = q.reader("a").get(1, timeout=0).rows[0]
    assert row.fields == {"x": 1, "y": 2} and row.tags == {"n": 3}
    q.put_columns(["j"], {"x": [1]})
    untagged = q.reader("a").get(1, timeout=0).rows[0]
    with pytest.raises(TypeError, match="read-only"):
        untagged.tags["n"] = 1  # type: ignore[index]


def test_replica_ranks_get_one_batch_whichever_form_they_ask_for(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("trainer",))
    q.put_columns(list(range(4)), {"x": list(range(4))})
    readers = [q.reader("trainer", ["x"], FixedSizeBatcher(2), replica=ReplicaSet("dp", r, 2)) for r in range(2)]
    columns = readers[0].get_columns(timeout=0)
    rows = readers[1].get(timeout=0)
    assert columns.lease_id == rows.lease_id and rows.keys == columns.keys == [0, 1]
    readers[0].ack(columns)
    readers[1].ack(rows)
    rows = readers[1].get(timeout=0)
    columns = readers[0].get_columns(timeout=0)
    assert columns.keys == rows.keys == [2, 3] and columns.column("x") == [2, 3]
    readers[0].ack(columns)
    readers[1].ack(rows)
    assert len(q) == 0


def test_async_put_columns_blocks_until_a_consumer_frees_room(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a",), max_rows=2)
    aq = AsyncTransferQueue(q)
    reader = aq.reader("a", ["x"], FixedSizeBatcher(2))

    async def main() -> list[Any]:
        await aq.put_columns([0, 1], {"x": [0, 1]})
        blocked = asyncio.ensure_future(aq.put_columns([2, 3], {"x": [2, 3]}, timeout=5))
        await asyncio.sleep(0.05)
        assert not blocked.done()
        first = await reader.get_columns(timeout=1)
        reader.ack(first)
        await blocked
        second = await reader.get_columns(timeout=1)
        reader.ack(second)
        return [first.keys, second.keys]

    assert asyncio.run(main()) == [[0, 1], [2, 3]]
    assert q.metrics()["put_waits"] == 1
