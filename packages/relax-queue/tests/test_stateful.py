"""Hypothesis stateful test: random interleavings of every operation against a reference model.

Operations: put (ungrouped rows and partial/complete groups), add-field, get, ack, nack, lease
expiry, version bump, snapshot + restore. After every step the invariants hold: no row lost, no
acked row redelivered to its task, capacity never exceeded, no row delivered to the trainer staler
than τ, groups never split.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from relax_queue import (
    BoundedStaleness,
    Capacity,
    FixedSizeBatcher,
    GroupBatcher,
    LeaseError,
    QueueConfig,
    QueueFullError,
    QueueTimeoutError,
    RowInput,
    TaskSpec,
    TransferQueue,
)

TAU = 1
MAX_ROWS = 12
TASKS = ("reward", "trainer")
FIELDS = {"reward": ("x",), "trainer": ("x", "r")}


@dataclass
class ModelRow:
    group: str
    size: int
    v_min: int
    fields: set[str] = field(default_factory=lambda: {"x"})
    done: set[str] = field(default_factory=set)


def _config() -> QueueConfig:
    return QueueConfig(
        tasks=(TaskSpec("reward"), TaskSpec("trainer", check_staleness=True)),
        capacity=Capacity(max_rows=MAX_ROWS),
        staleness=BoundedStaleness(tau=TAU, on_stale="drop"),
        lease_timeout_s=3600.0,
    )


class QueueMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.q = TransferQueue(_config())
        self.version = 0
        self.next_id = 0
        self.rows: dict[str, ModelRow] = {}
        self.missing: dict[str, list[str]] = {}  # group -> keys not put yet
        self.leases: dict[int, tuple[str, list[str]]] = {}
        self.dead_leases: list[int] = []

    # ---------------------------------------------------------------- producers
    @rule(size=st.integers(1, 3), now=st.integers(1, 3), age=st.integers(0, 3))
    def put_group(self, size: int, now: int, age: int) -> None:
        gid = f"g{self.next_id}"
        self.next_id += 1
        keys = [f"{gid}/{i}" for i in range(size)]
        v = max(0, self.version - age)
        if size == 1:  # an ungrouped row
            rows = [RowInput(keys[0], {"x": 1}, versions=v)]
        else:
            rows = [RowInput(k, {"x": 1}, versions=v, group_id=gid, group_size=size) for k in keys[: min(now, size)]]
        self._put(rows, gid, size, v)
        self.missing[gid] = [k for k in keys if k not in self.rows] if any(k in self.rows for k in keys) else []

    @precondition(lambda self: any(self.missing.values()))
    @rule(data=st.data())
    def complete_group(self, data: st.DataObject) -> None:
        gid = data.draw(st.sampled_from(sorted(g for g, keys in self.missing.items() if keys)))
        first = (
            next(r for k, r in self.rows.items() if r.group == gid)
            if any(r.group == gid for r in self.rows.values())
            else None
        )
        if first is None:  # the group's rows were dropped meanwhile
            self.missing[gid] = []
            return
        rows = [
            RowInput(k, {"x": 1}, versions=first.v_min, group_id=gid, group_size=first.size) for k in self.missing[gid]
        ]
        self._put(rows, gid, first.size, first.v_min)
        self.missing[gid] = [k for k in self.missing[gid] if k not in self.rows]

    def _put(self, rows: list[RowInput], gid: str, size: int, v: int) -> None:
        if len(self.rows) + len(rows) > MAX_ROWS:
            try:
                self.q.put_many(rows, timeout=0)
            except QueueFullError as err:
                stored = err.inserted
            else:
                raise AssertionError("put_many beyond max_rows did not raise QueueFullError")
        else:
            self.q.put_many(rows, timeout=0)
            stored = [r.key for r in rows]
        for key in stored:
            self.rows.setdefault(str(key), ModelRow(gid, size, v))

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def add_reward(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.rows)))
        assert self.q.add_fields(key, {"r": 1.0})
        self.rows[key].fields.add("r")

    # ---------------------------------------------------------------- consumers
    @rule(task=st.sampled_from(TASKS), n=st.integers(1, 4))
    def get(self, task: str, n: int) -> None:
        batcher = GroupBatcher(n, partial=True) if task == "reward" else FixedSizeBatcher(n, partial=True)
        try:
            batch = self.q.reader(task, FIELDS[task], batcher).get(timeout=0)
        except QueueTimeoutError:
            batch = None
        self._reconcile_drops()
        if batch is None:
            return
        leased = {k for t, keys in self.leases.values() if t == task for k in keys}
        groups: dict[str, int] = {}
        for row in batch.rows:
            key = str(row.key)
            assert key in self.rows, f"{key} delivered but not stored"
            model = self.rows[key]
            assert task not in model.done, f"{key} redelivered to {task} after ack"
            assert key not in leased, f"{key} leased twice to {task}"
            assert set(FIELDS[task]) <= model.fields
            if task == "trainer":
                assert row.staleness <= TAU and self.version - model.v_min <= TAU
            groups[model.group] = groups.get(model.group, 0) + 1
        for gid, count in groups.items():
            size = next(r.size for r in self.rows.values() if r.group == gid)
            assert count == size, f"group {gid} split: {count} of {size}"
        self.leases[batch.lease_id] = (task, [str(k) for k in batch.keys])

    def _reconcile_drops(self) -> None:
        """Rows gone from the queue without being consumed must have been stale for the trainer."""
        live = {str(r["key"]) for r in self.q.state_dict()["rows"]}
        for key in [k for k in self.rows if k not in live]:
            model = self.rows[key]
            members = [r for r in self.rows.values() if r.group == model.group]
            assert "trainer" not in model.done, f"{key} lost"
            assert self.version - min(r.v_min for r in members) > TAU, f"{key} lost without being stale"
            assert all("r" in r.fields for r in members), f"{key} dropped before the trainer could see it"
            del self.rows[key]

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), action=st.sampled_from(["ack", "nack", "expire"]))
    def settle(self, data: st.DataObject, action: str) -> None:
        lease_id = data.draw(st.sampled_from(sorted(self.leases)))
        task, keys = self.leases.pop(lease_id)
        if action == "ack":
            self.q.ack(lease_id)
            for key in keys:
                if key in self.rows:
                    self.rows[key].done.add(task)
                    if self.rows[key].done == set(TASKS):
                        del self.rows[key]
        elif action == "nack":
            self.q.nack(lease_id)
        else:
            self.q.renew(lease_id, -1.0)  # its deadline is now in the past
            self.dead_leases.append(lease_id)

    @precondition(lambda self: self.dead_leases)
    @rule()
    def ack_expired_fails(self) -> None:
        lease_id = self.dead_leases.pop()
        try:
            self.q.ack(lease_id)
        except LeaseError:
            return
        raise AssertionError(f"expired lease {lease_id} was acked")

    # ---------------------------------------------------------------- trainer and recovery
    @rule()
    def bump_version(self) -> None:
        self.version += 1
        self.q.publish_version(self.version)

    @rule()
    def snapshot_restore(self) -> None:
        state = self.q.state_dict()
        self.q = TransferQueue(_config())
        self.q.load_state_dict(state)
        self.dead_leases.extend(self.leases)
        self.leases.clear()  # leased rows come back as pending

    # ---------------------------------------------------------------- invariants
    @invariant()
    def matches_model(self) -> None:
        m = self.q.metrics()
        assert m["depth_rows"] == len(self.rows) <= MAX_ROWS
        assert m["depth_bytes"] == sum(8 * len(r.fields) for r in self.rows.values())
        for task in TASKS:
            todo = sum(task not in r.done for r in self.rows.values())
            t = m["tasks"][task]
            leased = sum(len([k for k in keys if k in self.rows]) for tt, keys in self.leases.values() if tt == task)
            assert t["backlog"] + leased == todo, (task, t, leased, todo)
        assert max(m["tasks"]["trainer"]["staleness_histogram"], default=0) <= TAU


QueueMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestQueueMachine = QueueMachine.TestCase
