"""Staleness control: AReaL admission pacing and the consumption-time check (drop/requeue/flag)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from relax_queue import AdmissionError, BoundedStaleness, ConfigError, RowInput, TaskSpec, TransferQueue, VersionError

MakeQueue = Callable[..., TransferQueue]
TRAINER = TaskSpec("trainer", check_staleness=True)


def test_admission_formula_by_hand(make_queue: MakeQueue) -> None:
    # tau=1, B=4: at V=0, (1+0+1)*4 = 8 samples may start.
    q = make_queue(tasks=(TRAINER,), tau=1, batch_size=4)
    assert q.admission_capacity() == 8
    assert q.admit(5) == 5  # running 5
    assert q.admit(5) == 3  # only 3 left
    assert q.admit(1) == 0
    q.put_many([RowInput(i, {"x": i}) for i in range(6)], admitted=True)  # accepted 6, running 2
    q.release_admission(1)  # an unused start: running 1
    q.release_admission(1, failed=True)  # a failed sample: running 0
    assert q.admission_capacity() == 8 - 6
    q.publish_version(1)  # (1+1+1)*4 - 6 = 6
    assert q.admission_capacity() == 6
    m = q.metrics()["admission"]
    assert (m["accepted"], m["running"], m["granted"], m["released"], m["failed"]) == (6, 0, 8, 1, 1)
    # A consumer took 4 rows without advancing the version (it filtered them out): (1+1+1)*4 - (6-4) = 10.
    q.refund_admission(4)
    assert q.admission_capacity() == 10
    m = q.metrics()["admission"]
    assert (m["accepted"], m["refunded"]) == (2, 4)
    with pytest.raises(AdmissionError, match="refund_admission"):
        q.refund_admission(-1)


def test_tau_infinity_admits_everything(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=(TRAINER,), tau=None)
    assert q.admission_capacity() is None
    assert q.admit(10**6) == 10**6


def test_admit_blocks_until_version_is_published(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=(TRAINER,), tau=0, batch_size=2)
    assert q.admit(2) == 2
    assert q.admit(1, timeout=0.02) == 0  # times out -> 0
    threading.Timer(0.05, q.publish_version, args=(1,)).start()
    start = time.monotonic()
    assert q.admit(3, timeout=2.0) == 2  # (0+1+1)*2 - (0+2) = 2
    assert time.monotonic() - start >= 0.04
    assert q.metrics()["admission"]["waits"] == 2


def test_paced_producer_never_generates_stale_rows(make_queue: MakeQueue) -> None:
    """A producer that only starts admitted samples is never dropped, for tau in {0, 1, 3}."""
    for tau in (0, 1, 3):
        q = make_queue(tasks=(TRAINER,), tau=tau, batch_size=4, max_rows=1000)
        reader = q.reader("trainer", ["x"])
        key = 0
        for step in range(10):
            while (k := q.admit(100)) > 0:  # produce greedily, as fast as admission allows
                q.put_many([RowInput(key + i, {"x": 1}, versions=q.version) for i in range(k)], admitted=True)
                key += k
            batch = reader.get(4, timeout=0)
            assert max(r.staleness for r in batch.rows) <= tau
            reader.ack(batch)
            q.publish_version(step + 1)
        m = q.metrics()
        assert m["drops"] == 0 and m["requeues"] == 0
        assert max(m["tasks"]["trainer"]["staleness_histogram"]) == tau  # the bound is reached, not exceeded


@pytest.mark.parametrize("action", ["drop", "requeue", "flag"])
def test_consumption_check(make_queue: MakeQueue, action: str) -> None:
    q = make_queue(tasks=(TRAINER, "reward"), tau=1, on_stale=action)
    q.put_many([RowInput(f"old{i}", {"x": i}, versions=(0, 2)) for i in range(2)])
    q.put_many([RowInput(f"g/{i}", {"x": i}, versions=(1 + i, 3), group_id="g", group_size=2) for i in range(2)])
    q.put("new", {"x": 9}, versions=3)
    q.publish_version(3)  # staleness: old* 3, group min v_min 1 -> 2, new 0
    batch = q.reader("trainer", ["x"]).get(5, timeout=0) if action == "flag" else None
    m = q.metrics()
    if action == "flag":
        assert batch is not None
        stale = {r.key: r.stale for r in batch.rows}
        assert stale == {"old0": True, "old1": True, "g/0": True, "g/1": False, "new": False}
        assert m["flagged"] == 3
        return
    reader = q.reader("trainer", ["x"])
    batch = reader.get(1, timeout=0)
    assert batch.keys == ["new"]
    assert batch.rows[0].staleness == 0
    m = q.metrics()
    assert m["drops" if action == "drop" else "requeues"] == 4  # a stale group goes whole
    assert len(q) == 1  # removed for every task, including reward
    if action == "requeue":
        requeued = q.take_requeued()
        assert sorted(str(r.key) for r in requeued) == ["g/0", "g/1", "old0", "old1"]
        assert q.take_requeued() == []
        q.put("old0", {"x": 0}, versions=3)  # a regenerated row may reuse its key
        assert len(q) == 2
    else:
        q.put("old0", {"x": 0}, versions=3)  # a dropped key is retired
        assert len(q) == 1
    assert q.metrics()["admission"]["accepted"] == 5 - 4 + (1 if action == "requeue" else 0)


def test_staleness_not_checked_for_other_tasks(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("reward",), tau=0)
    q.put("k", {"x": 1}, versions=0)
    q.publish_version(5)
    row = q.reader("reward").get(1, timeout=0).rows[0]
    assert (row.staleness, row.stale) == (5, False)


def test_version_and_policy_errors(make_queue: MakeQueue) -> None:
    q = make_queue(tasks=("a",))
    q.publish_version(2)
    with pytest.raises(VersionError, match="backwards"):
        q.publish_version(1)
    with pytest.raises(ConfigError, match="on_stale"):
        BoundedStaleness(tau=1, on_stale="explode")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="tau"):
        BoundedStaleness(tau=-1)


def test_regenerated_duplicate_put_settles_no_admission(make_queue: MakeQueue) -> None:
    # A producer that dies after putting its rows but before reporting success is restarted and puts the same
    # keys again, without a new admission: the first put settled the rows' admissions. The second put stores
    # nothing and must settle nothing, or it would settle another sample's admission (one still in flight).
    q = make_queue(tasks=("t",), tau=0, batch_size=4)
    assert q.admit(4) == 4  # samples a, b (the producer that will retry) and c, d (another, still generating)
    q.put("a", {"x": 1}, admitted=True)
    q.put("b", {"x": 2}, admitted=True)
    q.put("a", {"x": 1}, admitted=True)  # the retry: a duplicate of a stored row
    q.put_many([RowInput("b", {"x": 2})], admitted=True)
    m = q.metrics()["admission"]
    assert (m["accepted"], m["running"], m["duplicates"], m["unmatched"]) == (2, 2, 2, 0)
    assert q.admit(1) == 0  # (0 + 0 + 1)·4 − (2 accepted + 2 running): c and d are still in flight
    q.put_many([RowInput("c", {"x": 3}), RowInput("d", {"x": 4})], admitted=True)
    m = q.metrics()["admission"]
    assert (m["accepted"], m["running"], m["granted"], m["unmatched"]) == (4, 0, 4, 0)
    # A retired key (consumed and acked) put again settles nothing either.
    q.publish_version(1)
    assert q.admit(4) == 4
    reader = q.reader("t")
    batch = reader.get(4, timeout=1.0)
    reader.ack(batch)
    q.put("a", {"x": 1}, admitted=True)
    assert q.metrics()["admission"]["running"] == 4


def test_checkpoint_between_put_and_ack_grants_no_extra_admission(make_queue: MakeQueue) -> None:
    """A prompt group leased when the prompt queue is saved, whose samples are put (and the prompt acked) before
    the sample queue is saved, comes back as a redelivered prompt and as stored samples. Its regeneration is a
    duplicate put: the restored queue must still grant no more than (τ + V + 1)·B samples in all."""
    b = 4  # two groups of 2 per update, τ = 0
    prompts = make_queue(tasks=("rollout",))
    samples = make_queue(tasks=(TRAINER,), tau=0, batch_size=b)
    assert samples.admit(b) == b  # the feeder admits both groups, then puts their prompts
    prompts.put_many([RowInput("g0", {"p": 0}), RowInput("g1", {"p": 1})])
    rollout = prompts.reader("rollout")
    g0 = rollout.get(1, timeout=1.0)
    assert [r.key for r in g0.rows] == ["g0"]
    prompt_state = prompts.state_dict()  # g0 is leased here
    group0 = [RowInput(("g0", j), {"r": j}, group_id="g0", group_size=2) for j in range(2)]
    samples.put_many(group0, admitted=True)
    rollout.ack(g0)
    sample_state = samples.state_dict()  # g0's samples are stored here; g1's admission is still running
    assert sample_state["running"] == 2

    prompts2 = make_queue(tasks=("rollout",))
    samples2 = make_queue(tasks=(TRAINER,), tau=0, batch_size=b)
    prompts2.load_state_dict(prompt_state, reset_running=False)
    samples2.load_state_dict(sample_state, reset_running=False)
    again = prompts2.reader("rollout").get(2, timeout=1.0)
    assert sorted(r.key for r in again.rows) == ["g0", "g1"]  # g0 redelivered, g1 delivered
    samples2.put_many(group0, admitted=True)  # g0 regenerated: the same keys, already stored
    assert samples2.admit(2) == 0  # g1 is in flight: (0 + 0 + 1)·4 − (2 + 2)
    samples2.put_many([RowInput(("g1", j), {"r": j}, group_id="g1", group_size=2) for j in range(2)], admitted=True)
    m = samples2.metrics()["admission"]
    assert (m["accepted"], m["running"], m["duplicates"], m["unmatched"]) == (4, 0, 2, 0)
    assert samples2.admit(2) == 0  # nothing more until the trainer publishes version 1
