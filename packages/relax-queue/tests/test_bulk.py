"""The bulk paths (one bookkeeping pass per put_many / batch / ack) keep the per-row guarantees."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator

import pytest

from relax_queue import (
    Batch,
    BoundedStaleness,
    Capacity,
    FieldTypeError,
    FixedSizeBatcher,
    QueueConfig,
    QueueTimeoutError,
    RowInput,
    TaskSpec,
    TransferQueue,
)
from relax_queue._batchers import Unit

MakeQueue = Callable[..., TransferQueue]


class GenericFixedSize(FixedSizeBatcher):
    """The same selection rule, but not the exact type the queue's fast path recognises."""

    def select(self, units: Iterator[Unit], n: int | None) -> list[Unit] | None:
        return super().select(units, n)


def test_put_many_stores_rows_before_a_bad_one_and_settles_their_admissions(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a", "b"), tau=10, batch_size=100)
    assert q.admit(4) == 4
    rows = [RowInput("k0", {"x": 0}), RowInput("k1", {"x": 1}), RowInput("bad", {"x": 2}, versions=(3, 1))]
    with pytest.raises(FieldTypeError, match="versions"):
        q.put_many([*rows, RowInput("k3", {"x": 3})], admitted=True)
    m = q.metrics()
    assert (m["puts"], m["admission"]["accepted"], m["admission"]["running"]) == (2, 2, 2)
    for task in ("a", "b"):
        batch = q.reader(task, ["x"], FixedSizeBatcher(5, partial=True)).get(timeout=0)
        assert batch.keys == ["k0", "k1"]
    with pytest.raises(FieldTypeError, match="RowInput items, got dict at index 1"):
        q.put_many([RowInput("k4", {"x": 4}), {"key": "k5"}])  # type: ignore[list-item]
    assert len(q) == 3


def test_fast_fixed_size_path_matches_the_generic_batcher_path() -> None:
    """Random puts, field additions, nacks and gets: the exact FixedSizeBatcher (fast path) and a
    subclass (generic unit path) deliver the same keys, fields and delivery counts."""
    rng = random.Random(7)
    config = QueueConfig(
        tasks=(TaskSpec("t", check_staleness=True),),
        capacity=Capacity(max_rows=None),
        staleness=BoundedStaleness(tau=1, on_stale="flag"),
    )
    queues = [TransferQueue(config), TransferQueue(config)]
    batchers = [FixedSizeBatcher(3, partial=True), GenericFixedSize(3, partial=True)]
    held: list[list[Batch]] = [[], []]
    next_key = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.35:
            keys = list(range(next_key, next_key + rng.randint(1, 4)))
            next_key += len(keys)
            fields = [{"x": k} if rng.random() < 0.6 else {"y": k} for k in keys]
            version = rng.randint(0, 3)
            for q in queues:
                q.put_many([RowInput(k, f, versions=version) for k, f in zip(keys, fields, strict=True)])
        elif op < 0.45 and next_key:
            key = rng.randrange(next_key)
            for q in queues:
                q.add_fields(key, {"x": -key})
        elif op < 0.5:
            for q in queues:
                q.publish_version(q.version + 1)
        elif op < 0.6 and held[0]:
            i = rng.randrange(len(held[0]))
            for q, h in zip(queues, held, strict=True):
                q.nack(h.pop(i))
        else:
            n = rng.choice([None, 1, 2, 5])
            fields_wanted = rng.choice([("x",), ("x", "y"), None])
            results: list[Batch | None] = []
            for q, b in zip(queues, batchers, strict=True):
                try:
                    results.append(q.reader("t", fields_wanted, b).get(n, timeout=0))
                except QueueTimeoutError:
                    results.append(None)
            fast, generic = results
            if fast is None or generic is None:
                assert fast is generic
                continue
            seen = [(r.key, r.fields, r.staleness, r.stale, r.deliveries) for r in fast]
            assert seen == [(r.key, r.fields, r.staleness, r.stale, r.deliveries) for r in generic]
            hold = rng.random() < 0.5
            for q, h, batch in zip(queues, held, results, strict=True):
                if hold:
                    h.append(batch)
                else:
                    q.ack(batch)
    for q in queues[1:]:
        assert q.metrics()["tasks"] == queues[0].metrics()["tasks"]


def test_many_settled_leases_keep_the_deadline_heap_small_and_expiry_working(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a",), max_rows=None)
    reader = q.reader("a")
    q.put("held", {"x": 0})
    held = reader.get(1, timeout=0)
    for i in range(2000):
        q.put(i, {"x": i})
        batch = reader.get(1, timeout=0)
        if i % 100 == 0:
            reader.renew(batch, 0.3)
        reader.ack(batch)
    assert len(q._core.lease_heap) < 200  # settled leases do not pile up until their deadline
    reader.renew(held, 0.05)
    time.sleep(0.1)
    assert reader.get(1, timeout=1.0).keys == [held.keys[0]]  # the unsettled lease still expires
    assert q.metrics()["expired_leases"] == 1
