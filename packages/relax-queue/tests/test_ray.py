"""Ray transport: named actor, picklable clients, object-store payloads, a consumer killed mid-lease."""

from __future__ import annotations

import sys
import time
from typing import Any

import pytest

from relax_queue import (
    Capacity,
    FieldTypeError,
    FixedSizeBatcher,
    GroupBatcher,
    LeaseError,
    QueueClosedError,
    QueueConfig,
    QueueTimeoutError,
    RayQueueClient,
    RowInput,
    TaskSpec,
    UnknownTaskError,
    connect,
    create_ray_queue,
)
from relax_queue._ray import StoreRef

pytestmark = pytest.mark.integration
np = pytest.importorskip("numpy")


@pytest.fixture
def ray(ray_session: Any) -> Any:
    # Test-module actors travel by value (the module is not importable by name in workers).
    ray_session.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return ray_session


def _config(lease_timeout_s: float = 30.0, **capacity: Any) -> QueueConfig:
    return QueueConfig(
        tasks=(TaskSpec("reward"), TaskSpec("trainer", check_staleness=True)),
        capacity=Capacity(**capacity) if capacity else Capacity(),
        lease_timeout_s=lease_timeout_s,
    )


def test_round_trip_large_payloads_via_object_store_and_errors(ray: Any) -> None:
    client = create_ray_queue("rt", _config(), object_store_threshold=1024)
    try:
        big = np.arange(100_000, dtype=np.float32)  # 400 kB -> object store
        client.put_many([RowInput("big", {"x": big, "meta": "small"}), RowInput("s", {"x": 1.5, "meta": "m"})])
        stored = client._call("state_dict")["rows"]
        kinds = {row["key"]: type(row["fields"]["x"]) for row in stored}
        assert kinds["big"] is StoreRef and kinds["s"] is float  # the actor only holds a reference
        assert client.metrics()["depth_bytes"] == big.nbytes + 8 + len("small") + len("m")
        assert (client.ready("reward", ["x", "meta"]), client.ready("reward", ["x", "y"])) == (2, 0)
        batch = client.reader("reward", ["x"], FixedSizeBatcher(2)).get(timeout=10)
        assert batch.keys == ["big", "s"]
        np.testing.assert_array_equal(batch.rows[0].fields["x"], big)
        client.ack(batch)
        with pytest.raises(UnknownTaskError, match="nope"):
            client.reader("nope").get(timeout=0)
        with pytest.raises(QueueTimeoutError):
            client.reader("reward").get(1, timeout=0.05)
        with pytest.raises(ValueError):
            create_ray_queue("rt", _config())  # one actor per name
    finally:
        client.shutdown()


def test_save_load_inlines_object_store_values(ray: Any, tmp_path: Any) -> None:
    client = create_ray_queue("snap", _config(), object_store_threshold=1024)
    try:
        big = np.ones(10_000, dtype=np.float64)
        client.put("k", {"x": big})
        leased = client.reader("reward", ["x"]).get(1, timeout=10)
        client.save(str(tmp_path / "q.pkl"))
        client.load(str(tmp_path / "q.pkl"))
        again = client.reader("reward", ["x"]).get(1, timeout=10)
        assert again.keys == leased.keys and again.rows[0].deliveries == 2
        np.testing.assert_array_equal(again.rows[0].fields["x"], big)
    finally:
        client.shutdown()


def _produce_then_die(ray: Any, client: RayQueueClient, produce: Any) -> None:
    """Run ``produce(client)`` in an actor (which owns its ray.put objects), then kill it and wait until it is gone."""

    @ray.remote(num_cpus=0)
    class OneShot:
        def produce(self, c: RayQueueClient) -> None:
            produce(c)

    producer = OneShot.remote()
    ray.get(producer.produce.remote(client), timeout=60)
    ray.kill(producer)
    with pytest.raises(ray.exceptions.RayActorError):  # returns once the process is gone
        ray.get(producer.produce.remote(client), timeout=60)


def test_large_values_outlive_their_producer(ray: Any) -> None:
    # Without adoption (durable_payloads=False) Ray frees a dead owner's objects asynchronously, so
    # that read fails only most of the time; the durable read below must succeed every time.
    client = create_ray_queue("durable", _config(), object_store_threshold=1024)
    try:
        _produce_then_die(ray, client, lambda c: c.put("k", {"x": np.full(50_000, 7, dtype=np.int64)}))
        batch = client.reader("reward", ["x"]).get(1, timeout=10)
        assert int(batch.rows[0].fields["x"].sum()) == 7 * 50_000
    finally:
        client.shutdown()


def _producer_cls(ray: Any) -> Any:
    @ray.remote(num_cpus=0)
    class Producer:
        def __init__(self, client: RayQueueClient) -> None:
            self.client = client  # a pickled client handle

        def run(self, pid: int, groups: int, group_size: int) -> int:
            for g in range(groups):
                rows = [
                    RowInput(
                        f"p{pid}g{g}r{i}",
                        {"tokens": np.full(20_000, i, dtype=np.int32), "pid": pid},
                        group_id=f"p{pid}g{g}",
                        group_size=group_size,
                    )
                    for i in range(group_size)
                ]
                self.client.put_many(rows, timeout=240)
            return groups * group_size

    return Producer


def _consumer_cls(ray: Any) -> Any:
    @ray.remote(num_cpus=0)
    class Consumer:
        def __init__(self, name: str, task: str) -> None:
            self.client = connect(name, object_store_threshold=1024)  # reconnect by name
            self.task = task

        def hold_one(self) -> list[str]:
            """Lease a batch and never ack it (the test then kills this actor)."""
            batch = self.client.reader(self.task, ["tokens"], GroupBatcher(1)).get(timeout=30)
            return [str(k) for k in batch.keys]

        def drain(self, expected: int) -> list[tuple[str, int]]:
            reader = self.client.reader(self.task, ["tokens", "pid"], GroupBatcher(2, partial=True))
            seen: list[tuple[str, int]] = []
            while len(seen) < expected:
                batch = reader.get(timeout=90)
                for row in batch.rows:
                    assert int(row.fields["tokens"][0]) == int(str(row.key).rsplit("r", 1)[1])
                    seen.append((str(row.key), row.deliveries))
                if self.task == "reward":
                    self.client.add_fields_many({k: {"reward": 1.0} for k in batch.keys})
                reader.ack(batch)
            return seen

    return Consumer


@pytest.mark.timeout(600)
def test_multi_process_producers_two_tasks_killed_consumer_exact_accounting(ray: Any) -> None:
    name = "mp"
    client = create_ray_queue(name, _config(lease_timeout_s=1.5, max_rows=24), object_store_threshold=1024)
    try:
        producer_cls, consumer_cls = _producer_cls(ray), _consumer_cls(ray)
        producers = [producer_cls.remote(client) for _ in range(3)]
        victim = consumer_cls.remote(name, "trainer")
        reward = consumer_cls.remote(name, "reward")
        trainer = consumer_cls.remote(name, "trainer")
        runs = [p.run.remote(pid, 5, 4) for pid, p in enumerate(producers)]  # 60 rows, capacity 24: backpressure
        t0 = time.monotonic()  # before the lease is taken, so its expiry comes at least 1.5 s after
        held = ray.get(victim.hold_one.remote(), timeout=60)
        assert len(held) == 4
        ray.kill(victim)  # dies holding a lease
        drained = [reward.drain.remote(60), trainer.drain.remote(60)]
        assert sum(ray.get(runs, timeout=240)) == 60
        reward_seen, trainer_seen = ray.get(drained, timeout=240)
        expected = sorted(f"p{p}g{g}r{i}" for p in range(3) for g in range(5) for i in range(4))
        assert sorted(k for k, _ in reward_seen) == expected  # every key exactly once per task
        assert sorted(k for k, _ in trainer_seen) == expected
        redelivered = sorted(k for k, d in trainer_seen if d == 2)
        assert redelivered == sorted(held)  # exactly the dead consumer's rows came again
        assert time.monotonic() - t0 >= 1.5  # only after the lease expired
        with pytest.raises(QueueTimeoutError):  # nothing is left over
            client.reader("trainer").get(1, timeout=0.5)
        m = client.metrics()
        assert m["depth_rows"] == 0 and m["depth_bytes"] == 0
        assert m["expired_leases"] == 1 and m["redeliveries"] == 4
        assert m["tasks"]["trainer"]["acked"] == 60 and m["tasks"]["reward"]["acked"] == 60
        for actor in (*producers, reward, trainer):
            ray.kill(actor)
    finally:
        client.shutdown()


def test_columns_travel_in_one_call_with_large_values_through_the_object_store(ray: Any) -> None:
    client = create_ray_queue("cols", _config(), object_store_threshold=1024)
    try:
        big = np.arange(50_000, dtype=np.float32)
        client.put_columns(
            ["a", "b", "c"], {"x": [big, 2.0, big * 2]}, v_min=[0, 1, 1], v_max=1, tags={"num_tokens": [3, 4, 5]}
        )
        stored = {row["key"]: type(row["fields"]["x"]) for row in client._call("state_dict")["rows"]}
        assert stored == {"a": StoreRef, "b": float, "c": StoreRef}
        reader = client.reader("trainer", ["x"], FixedSizeBatcher(3))
        batch = reader.get_columns(timeout=10)
        assert batch.keys == ["a", "b", "c"] and batch.v_min == [0, 1, 1] and batch.v_max == [1, 1, 1]
        assert [dict(t) for t in batch.tags] == [{"num_tokens": n} for n in (3, 4, 5)]
        np.testing.assert_array_equal(batch.column("x")[0], big)
        np.testing.assert_array_equal(batch.column("x")[2], big * 2)
        reader.nack(batch)
        again = reader.get_columns(timeout=10)
        assert again.deliveries == [2, 2, 2] and again.column("x")[1] == 2.0
        reader.ack(again)
        with pytest.raises(FieldTypeError, match="column 'x' has 1 values for 2 keys"):
            client.put_columns(["d", "e"], {"x": [1]})
        with pytest.raises(UnknownTaskError, match="nope"):
            client.get_columns("nope", timeout=0)
        assert client.metrics()["tasks"]["trainer"]["acked"] == 3
    finally:
        client.shutdown()


def test_get_acks_the_previous_batch_in_the_same_round_trip(ray: Any) -> None:
    client = create_ray_queue("ack-get", _config(lease_timeout_s=0.5))
    try:
        client.put_columns(list(range(6)), {"x": list(range(6))})
        reader = client.reader("reward", ["x"], FixedSizeBatcher(2))
        first = reader.get_columns(timeout=10)
        second = reader.get(timeout=10, ack=first)  # rows 0, 1 consumed, 2, 3 leased
        assert client.metrics()["tasks"]["reward"]["acked"] == 2
        time.sleep(0.6)  # the lease of `second` expires: its rows go back to the task
        with pytest.raises(LeaseError, match=str(second.lease_id)):
            reader.get_columns(timeout=10, ack=second)
        # The failed ack leased nothing: the expired rows come back first, then the rest.
        third = reader.get_columns(timeout=10)
        assert third.keys == [2, 3] and third.deliveries == [2, 2]
        last = reader.get_columns(timeout=10, ack=third)
        reader.ack(last)
        m = client.metrics()["tasks"]["reward"]
        assert (m["acked"], client.ready("reward")) == (6, 0)
    finally:
        client.shutdown()


def test_uniform_metadata_columns_travel_once_and_come_back_row_for_row() -> None:
    import pickle

    from relax_queue._core import NO_TAGS
    from relax_queue._wire import pack_column as _pack
    from relax_queue._wire import pack_tags as _pack_tags
    from relax_queue._wire import unpack_column as _unpack

    def through_the_wire(column: list[Any], tags: bool = False) -> list[Any]:
        packed = pickle.loads(pickle.dumps(_pack_tags(column) if tags else _pack(column)))
        return _unpack(packed, len(column))

    for column in ([3] * 4, [None] * 3, [False, False], [1, True], [1, 1.0], [0, 1, 1], [(1, 2)] * 2, []):
        out = through_the_wire(column)
        assert out == column and [type(v) for v in out] == [type(v) for v in column]
    assert len(pickle.dumps(_pack([7] * 10_000))) < 100  # sent once, not per row
    empty = through_the_wire([NO_TAGS, NO_TAGS], tags=True)
    assert empty == [{}, {}] and all(t is NO_TAGS for t in empty)  # read-only, as in-process
    tagged = through_the_wire([{"n": 1}, NO_TAGS], tags=True)
    assert tagged == [{"n": 1}, {}]


def test_large_values_of_a_column_share_objects_up_to_the_chunk_cap(ray: Any, tmp_path: Any) -> None:
    values = [np.full(2_000, i, dtype=np.float64) for i in range(5)]  # 16 kB each -> object store
    client = create_ray_queue("chunks", _config(), object_store_threshold=1024, object_store_chunk_bytes=40_000)
    try:
        client.put_columns(list("abcdef"), {"x": [*values[:2], "small", *values[2:]]})
        refs = {row["key"]: row["fields"]["x"] for row in client._call("state_dict")["rows"]}
        assert refs["c"] == "small"
        # Two values fit under the 40 kB cap: objects {a, b}, {d, e}, then f alone (no index).
        assert [(refs[k].ref == refs["a"].ref, refs[k].index) for k in "ab"] == [(True, 0), (True, 1)]
        assert [(refs[k].ref == refs["d"].ref, refs[k].index) for k in "de"] == [(True, 0), (True, 1)]
        assert refs["a"].ref != refs["d"].ref and refs["f"].index is None
        assert client.metrics()["depth_bytes"] == 5 * values[0].nbytes + len("small")
        trainer = client.reader("trainer", ["x"], FixedSizeBatcher(3))
        first = trainer.get(timeout=10)  # rows, not columns: the same objects resolve per row
        assert first.keys == ["a", "b", "c"]
        np.testing.assert_array_equal(first.rows[1].fields["x"], values[1])
        client.save(str(tmp_path / "q.pkl"))  # the snapshot holds each row's own value
        client.load(str(tmp_path / "q.pkl"))
        cols = client.reader("reward", ["x"], FixedSizeBatcher(6)).get_columns(timeout=10)
        for got, want in zip([cols.column("x")[i] for i in (0, 1, 3, 4, 5)], values, strict=True):
            np.testing.assert_array_equal(got, want)
    finally:
        client.shutdown()


def test_a_column_object_outlives_its_dead_producer(ray: Any) -> None:
    client = create_ray_queue("durable-cols", _config(), object_store_threshold=1024)
    try:
        values = [np.full(5_000, 3, dtype=np.int64), np.full(5_000, 4, dtype=np.int64)]
        _produce_then_die(ray, client, lambda c: c.put_columns(["a", "b"], {"x": values}))
        batch = client.reader("reward", ["x"], FixedSizeBatcher(2)).get_columns(timeout=10)
        assert [int(v.sum()) for v in batch.column("x")] == [3 * 5_000, 4 * 5_000]
    finally:
        client.shutdown()


def test_an_array_column_travels_whole_and_comes_back_as_an_array(ray: Any) -> None:
    client = create_ray_queue("arrays", _config())
    try:
        obs = np.arange(3000, dtype=np.float32).reshape(1000, 3)
        client.put_columns(list(range(1000)), {"obs": obs, "act": np.arange(1000)}, v_min=np.int64(2))
        assert client.version == 0
        client.publish_version(3)
        assert client.version == 3
        trainer = client.reader("trainer", ["obs", "act"], FixedSizeBatcher(600))
        batch = trainer.get_columns(timeout=10)
        assert isinstance(batch.column("obs"), np.ndarray) and batch.column("obs").shape == (600, 3)
        np.testing.assert_array_equal(batch.column("obs"), obs[:600])
        np.testing.assert_array_equal(batch.column("act"), np.arange(600))
        assert batch.v_min == [2] * 600 and batch.staleness == [1] * 600
        rows = client.reader("reward", ["obs"]).get(2, timeout=10).rows  # the row API: one row each
        np.testing.assert_array_equal(rows[1].fields["obs"], obs[1])
    finally:
        client.shutdown()


def test_an_array_column_outlives_its_dead_producer(ray: Any) -> None:
    client = create_ray_queue("durable-arrays", _config())
    try:
        big = np.full((4, 100_000), 5, dtype=np.int64)  # 3.2 MB: Ray ships the argument via the object store
        _produce_then_die(ray, client, lambda c: c.put_columns(list("abcd"), {"x": big}))
        batch = client.reader("reward", ["x"], FixedSizeBatcher(4)).get_columns(timeout=10)
        assert int(batch.column("x").sum()) == 5 * big.size
    finally:
        client.shutdown()


def test_close_through_one_client_closes_the_queue_for_all(ray: Any) -> None:
    client = create_ray_queue("closing", _config())
    try:
        client.put("k", {"x": 1})
        other = connect("closing")
        other.close()
        with pytest.raises(QueueClosedError):
            client.put("j", {"x": 2})
        with pytest.raises(QueueClosedError):
            client.reader("reward", ["x"]).get(1, timeout=10)
        assert len(client) == 1 and client.metrics()["depth_rows"] == 1  # reads still work
    finally:
        client.shutdown()
