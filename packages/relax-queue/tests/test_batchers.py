"""Batchers: fixed size, whole groups, token budget, identical batches across replica ranks."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from relax_queue import (
    ConfigError,
    FieldTypeError,
    FixedSizeBatcher,
    GroupBatcher,
    QueueTimeoutError,
    ReplicaSet,
    RowInput,
    TokenBudgetBatcher,
    TransferQueue,
)

MakeQueue = Callable[..., TransferQueue]


def _put_group(q: TransferQueue, gid: str, size: int, present: int | None = None, **tags: int) -> None:
    q.put_many(
        [RowInput(f"{gid}/{i}", {"x": i}, group_id=gid, group_size=size, tags=tags) for i in range(present or size)]
    )


def test_fixed_size_exact_and_partial(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a",))
    q.put_many([RowInput(i, {"x": i}) for i in range(5)])
    exact = q.reader("a", batcher=FixedSizeBatcher(size=3))
    assert exact.get(timeout=0).keys == [0, 1, 2]
    with pytest.raises(QueueTimeoutError):
        exact.get(timeout=0)  # 2 rows left, batch of 3 waits
    partial = q.reader("a", batcher=FixedSizeBatcher(size=3, partial=True))
    assert partial.get(timeout=0).keys == [3, 4]


def test_groups_are_never_split(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a",))
    _put_group(q, "g1", size=4, present=3)  # incomplete
    _put_group(q, "g2", size=2)
    q.put("solo", {"x": 0})
    reader = q.reader("a", batcher=FixedSizeBatcher(size=3))
    # FIFO units: g2 (2 rows, complete), solo (1 row); g1 is not deliverable yet.
    assert sorted(reader.get(timeout=0).keys) == ["g2/0", "g2/1", "solo"]
    q.put("g1/3", {"x": 3}, group_id="g1", group_size=4)
    big = reader.get(timeout=0)  # a group larger than the batch size comes alone
    assert sorted(big.keys) == ["g1/0", "g1/1", "g1/2", "g1/3"]


def test_group_batcher_k_groups_and_field_readiness(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("trainer",))
    for gid in ("p0", "p1", "p2"):
        _put_group(q, gid, size=3)
    q.add_fields_many({f"p0/{i}": {"reward": 1.0} for i in range(3)})
    q.add_fields_many({f"p1/{i}": {"reward": 1.0} for i in range(2)})  # p1 lacks one reward
    q.add_fields_many({f"p2/{i}": {"reward": 1.0} for i in range(3)})
    reader = q.reader("trainer", ["x", "reward"], GroupBatcher(groups=2))
    batch = reader.get(timeout=0)
    assert sorted({r.group_id for r in batch.rows}) == ["p0", "p2"]  # type: ignore[type-var]
    assert len(batch) == 6
    with pytest.raises(QueueTimeoutError):
        reader.get(1, timeout=0)
    q.add_fields("p1/2", {"reward": 0.0})
    assert sorted(reader.get(1, timeout=0).keys) == ["p1/0", "p1/1", "p1/2"]


def test_token_budget(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a",))
    lengths = [40, 30, 50, 20, 200, 10]
    q.put_many([RowInput(i, {"x": i}, tags={"num_tokens": n}) for i, n in enumerate(lengths)])
    reader = q.reader("a", batcher=TokenBudgetBatcher(max_tokens=100))
    assert reader.get(timeout=0).keys == [0, 1]  # 40 + 30 = 70; + 50 would overflow
    assert reader.get(timeout=0).keys == [2, 3]  # 50 + 20; + 200 would overflow
    assert reader.get(timeout=0).keys == [4]  # above the budget alone
    with pytest.raises(QueueTimeoutError):
        reader.get(timeout=0)  # 10 tokens: not full and not partial
    q.put("bad", {"x": 0})
    with pytest.raises(FieldTypeError, match="num_tokens"):
        q.reader("a", batcher=TokenBudgetBatcher(max_tokens=100, partial=True)).get(timeout=0)


def test_batcher_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"FixedSizeBatcher\.size"):
        FixedSizeBatcher(size=0)
    with pytest.raises(ConfigError, match=r"TokenBudgetBatcher\.max_tokens"):
        TokenBudgetBatcher(max_tokens=-1)
    with pytest.raises(ConfigError, match="rank"):
        ReplicaSet("r", rank=2, world_size=2)


def test_replica_ranks_get_identical_batches(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("trainer",))
    q.put_many([RowInput(i, {"x": i}) for i in range(8)])
    world = 3
    readers = [
        q.reader("trainer", ["x"], FixedSizeBatcher(2), replica=ReplicaSet("dp0", r, world)) for r in range(world)
    ]
    got: dict[int, list[list[object]]] = {r: [] for r in range(world)}

    def rank_loop(rank: int) -> None:
        for _ in range(4):
            batch = readers[rank].get(timeout=5)
            got[rank].append(batch.keys)
            readers[rank].ack(batch)

    threads = [threading.Thread(target=rank_loop, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert got[0] == got[1] == got[2]
    assert sorted(k for keys in got[0] for k in keys) == list(range(8))  # type: ignore[type-var]
    assert len(q) == 0  # each lease acked once every rank acked


def test_replica_lease_needs_every_rank(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("t",))
    q.put_many([RowInput(i, {"x": i}) for i in range(2)])
    r0 = q.reader("t", batcher=FixedSizeBatcher(2), replica=ReplicaSet("s", 0, 2))
    r1 = q.reader("t", batcher=FixedSizeBatcher(2), replica=ReplicaSet("s", 1, 2))
    b0 = r0.get(timeout=0)
    r0.ack(b0)
    assert len(q) == 2  # rank 1 has not acked
    b1 = r1.get(timeout=0)
    assert b1.lease_id == b0.lease_id
    r1.ack(b1)
    assert len(q) == 0
