"""Several named queues in one Ray actor (``create_ray_queues``): each behaves exactly as a queue in an actor of its
own — the same calls give the same answers, values and versions — the queues stay apart, a get blocked on one never
holds up the other, and they share one process and its fate."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest

from relax_queue import (
    Capacity,
    FixedSizeBatcher,
    QueueConfig,
    RayQueueClient,
    RelaxQueueError,
    RowInput,
    TaskSpec,
    connect,
    create_ray_queue,
    create_ray_queues,
)

pytestmark = pytest.mark.integration
np = pytest.importorskip("numpy")


def _samples() -> QueueConfig:
    return QueueConfig(tasks=(TaskSpec("reward"), TaskSpec("trainer", check_staleness=True)), capacity=Capacity())


def _prompts() -> QueueConfig:
    return QueueConfig(tasks=(TaskSpec("rollout"),), capacity=Capacity(max_rows=8))


def _script(client: RayQueueClient, tmp: Any) -> list[Any]:
    """A fixed sequence of calls (rows, columns, object-store and chunked values, leases, acks with a version
    publish, a snapshot round trip, metrics); returns what each call gave back, as comparable plain values."""
    out: list[Any] = []
    big = np.arange(50_000, dtype=np.float32)  # through the object store
    mids = [np.full(2_000, i, dtype=np.float64) for i in range(3)]  # 16 kB each: chunked column pieces
    client.put_many([RowInput("r0", {"x": big, "m": "a"}, versions=0), RowInput("r1", {"x": 1.5, "m": "b"})])
    client.put_columns(["c0", "c1", "c2"], {"x": mids, "m": ["c", "d", "e"]}, v_min=[0, 1, 1], v_max=1)
    out.append((client.ready("reward", ["x", "m"]), len(client), client.version))
    reward = client.reader("reward", ["x", "m"], FixedSizeBatcher(5))
    rows = reward.get(timeout=30)
    out.append((rows.keys, [float(np.sum(r.fields["x"])) for r in rows.rows], [r.fields["m"] for r in rows.rows]))
    reward.ack(rows)
    client.save(str(tmp / "q.pkl"))
    client.load(str(tmp / "q.pkl"))
    trainer = client.reader("trainer", ["x"], FixedSizeBatcher(5))
    cols = trainer.get_columns(timeout=30)
    out.append((cols.keys, [float(np.sum(v)) for v in cols.column("x")], cols.v_min, cols.v_max, cols.staleness))
    trainer.ack_and_publish(cols, 1)
    metrics = client.metrics()
    out.append((client.version, metrics["depth_bytes"], metrics["tasks"]["trainer"]["acked"]))
    return out


def test_a_queue_in_a_group_answers_as_a_queue_of_its_own(ray_session: Any, tmp_path: Any) -> None:
    alone = create_ray_queue(
        "group-ref-alone", _samples(), object_store_threshold=1024, object_store_chunk_bytes=40_000
    )
    group = create_ray_queues(
        "group-ref",
        {"prompts": _prompts(), "samples": _samples()},
        object_store_threshold=1024,
        object_store_chunk_bytes=40_000,
    )
    try:
        (tmp_path / "a").mkdir()
        (tmp_path / "g").mkdir()
        expected = _script(alone, tmp_path / "a")
        assert expected[-1][0] == 1 and expected[1][0] == ["r0", "r1", "c0", "c1", "c2"]  # the script did its work
        assert _script(group["samples"], tmp_path / "g") == expected
        # The other queue of the group saw none of it.
        prompts = group["prompts"]
        assert (len(prompts), prompts.version, prompts.metrics()["depth_bytes"]) == (0, 0, 0)
    finally:
        alone.shutdown()
        group["samples"].shutdown()


def test_queues_in_a_group_stay_apart_and_share_one_process(ray_session: Any) -> None:
    ray = ray_session
    group = create_ray_queues("group-apart", {"prompts": _prompts(), "samples": _samples()})
    prompts, samples = group["prompts"], group["samples"]
    assert prompts.actor == samples.actor and prompts != samples
    try:
        # A get blocked on an empty queue does not hold up the other queue on the actor's one event loop.
        got: list[Any] = []
        waiter = threading.Thread(target=lambda: got.append(samples.reader("reward").get(1, timeout=120)))
        waiter.start()
        prompts.put_many([RowInput(f"p{i}", {"prompt": i}) for i in range(3)])
        batch = prompts.reader("rollout", ["prompt"], FixedSizeBatcher(3)).get(timeout=30)
        assert [r.fields["prompt"] for r in batch.rows] == [0, 1, 2]
        assert waiter.is_alive() and not got  # still waiting: nothing was put into the sample queue
        samples.put("s0", {"x": 7})
        waiter.join(timeout=120)
        assert [r.key for r in got[0].rows] == ["s0"]
        assert (len(prompts), len(samples)) == (3, 1)  # leased rows stay until acked, each in its own queue
        # Clients by name, pickled to another process too, address their own queue.
        again = connect("group-apart", queue="prompts")
        assert again == prompts and len(again) == 3

        @ray.remote(num_cpus=0)
        def depth(client: RayQueueClient) -> int:
            return len(client)

        assert ray.get(depth.remote(samples), timeout=120) == 1
        with pytest.raises(RelaxQueueError, match=r"no queue 'nope' in this actor; it holds: prompts, samples"):
            connect("group-apart", queue="nope").metrics()
        with pytest.raises(ValueError):
            create_ray_queues("group-apart", {"other": _prompts()})  # one actor per name
        with pytest.raises(ValueError, match="at least one queue"):
            create_ray_queues("group-empty", {})
        # One process, one fate: shutting down through either client ends both queues.
        prompts.shutdown()
        with pytest.raises(ray.exceptions.RayActorError):
            for _ in range(600):  # the kill lands within moments; bounded all the same
                samples.metrics()
    finally:
        ray.kill(samples.actor, no_restart=True)


class _Registry:
    """Other light state for the queue group actor's process (a ``host``)."""

    def __init__(self, start: int) -> None:
        self.count = start

    def bump(self, by: int) -> int:
        self.count += by
        return self.count


class _Clashing:
    def version(self) -> int:  # a queue actor method's name
        return 0


def test_a_host_class_shares_the_queue_actor_process(ray_session: Any) -> None:
    """The host's methods answer on the queues' actor, with its own state, beside queues that behave as always."""
    configs = {"a": QueueConfig(tasks=(TaskSpec("t"),)), "b": QueueConfig(tasks=(TaskSpec("t"),))}
    clients = create_ray_queues(f"group-host-{os.getpid()}", configs, host=_Registry, host_args=(10,))
    actor = clients["a"].actor
    try:
        assert clients["b"].actor == actor
        assert ray_session.get(actor.bump.remote(5)) == 15 and ray_session.get(actor.bump.remote(1)) == 16
        clients["a"].put_many([RowInput("r", {"x": 1})])
        batch = clients["a"].reader("t", ("x",), FixedSizeBatcher(1)).get(timeout=30)
        assert batch.keys == ["r"] and clients["b"].metrics()["depth_rows"] == 0
    finally:
        clients["a"].shutdown()
    with pytest.raises(ValueError, match="_Clashing cannot share a queue group actor: it has version"):
        create_ray_queues(f"group-clash-{os.getpid()}", configs, host=_Clashing)
