"""Choosing and leasing a task's next batch over a :class:`QueueCore` (callers hold its lock).

The batch of a plain ``FixedSizeBatcher`` reader is the first ready rows (tested in bulk, in C);
every other batcher sees the task's deliverable units (single rows and complete groups, stale ones
removed first) and picks among them. Bulk-put blocks answer in ranges where they can (``_blocks``).
"""

from __future__ import annotations

from collections.abc import Generator, Hashable
from itertools import islice, repeat
from operator import attrgetter, contains, ge
from typing import TYPE_CHECKING, cast

from relax_queue._batchers import Batcher, FixedSizeBatcher
from relax_queue._blocks import SLOW, Range, choose_ranges, explode, rows_batch
from relax_queue._fields import BULK, has_fields
from relax_queue._leasing import push_deadline
from relax_queue._rows import Lease, Segment, StoredRow, TaskState
from relax_queue._types import Batch, Row

if TYPE_CHECKING:
    from relax_queue._core import QueueCore

__all__ = ["choose", "ready", "take", "try_get"]

_row_fields = attrgetter("fields")


def ready(core: QueueCore, task: str, fields: tuple[str, ...] | None) -> int:
    """Rows ``task`` has not leased or consumed yet that carry every one of ``fields``."""
    ts = core.task(task)
    core.unblock()
    rows = core.rows
    if not fields:
        return len(ts.pending) + len(ts.retry)
    return sum(1 for source in (ts.retry, ts.pending) for key in source if all(f in rows[key].fields for f in fields))


def try_get(
    core: QueueCore, task: str, fields: tuple[str, ...] | None, n: int | None, batcher: Batcher, now: float
) -> Batch | None:
    """Lease the batch the batcher picks, or ``None`` when it wants to wait."""
    ts = core.tasks.get(task) or core.task(task)
    if core.blocks:
        ranges = choose_ranges(core, ts, fields, n, batcher, now)
        if ranges is not SLOW:
            return None if ranges is None else rows_batch(core, ts, fields, cast("list[Range]", ranges), now)
    rows = choose(core, ts, fields, n, batcher, now)
    return None if rows is None else _lease(core, ts, fields, rows, now)


def choose(
    core: QueueCore, ts: TaskState, fields: tuple[str, ...] | None, n: int | None, batcher: Batcher, now: float
) -> list[StoredRow] | None:
    """The rows of the next batch of ``ts`` (whole groups, none stale unless flagged), or ``None``.

    Expires due leases and removes the stale rows it meets first; leases nothing.
    """
    if core.blocks:
        explode(core)
    if core.lease_heap and core.lease_heap[0][0] <= now:
        core.expire(now)
    if type(batcher) is FixedSizeBatcher and not core.groups and not _drops_stale(core, ts):
        # Every unit is one row and none is removed as stale: the batch is the first ready rows.
        target = n or batcher.size
        rows = _ready_rows(core, ts, fields, target)
        if len(rows) < target and not (batcher.partial and rows):
            return None
        return rows
    stale: list[list[StoredRow]] = []
    units = _units(core, ts, fields, stale)
    try:
        chosen = batcher.select(units, n)
    finally:
        units.close()
    if stale:
        core.remove_stale(stale)
    if not chosen:
        return None
    # The batcher hands back units of the rows it was given.
    return cast("list[StoredRow]", [row for unit in chosen for row in unit])


def _drops_stale(core: QueueCore, ts: TaskState) -> bool:
    """Whether stale rows are removed (not only flagged) when ``ts`` consumes them."""
    return ts.spec.check_staleness and core.policy.on_stale != "flag"


def _ready_rows(core: QueueCore, ts: TaskState, fields: tuple[str, ...] | None, limit: int) -> list[StoredRow]:
    """Up to ``limit`` rows of ``ts`` in delivery order (redeliveries first) carrying all ``fields``."""
    rows = core.rows
    out: list[StoredRow] = []
    # One wanted field (the common case) is tested inline; several through a key-set comparison.
    one = fields[0] if fields and len(fields) == 1 else None
    need = frozenset(fields) if fields and one is None else frozenset()
    for source in (ts.retry, ts.pending):
        if len(out) == limit:
            break
        if not source:
            continue
        if not fields:
            out.extend(map(rows.__getitem__, islice(source, limit - len(out))))
            continue
        if limit - len(out) >= BULK:
            head = list(map(rows.__getitem__, islice(source, limit - len(out))))
            if (
                all(map(contains, map(_row_fields, head), repeat(one)))
                if one is not None
                else all(map(ge, map(dict.keys, map(_row_fields, head)), repeat(need)))
            ):
                out.extend(head)  # the usual case, tested in C: every row at the head of the queue is ready
                continue
        for key in source:
            row = rows[key]
            if (one in row.fields) if one is not None else (row.fields.keys() >= need):
                out.append(row)
                if len(out) == limit:
                    break
    return out


def _units(
    core: QueueCore, ts: TaskState, fields: tuple[str, ...] | None, stale: list[list[StoredRow]]
) -> Generator[list[StoredRow], None, None]:
    rows = core.rows
    policy = core.policy
    version = core.version
    drop_stale = _drops_stale(core, ts)
    has = has_fields(fields) if fields else None
    buckets: dict[Hashable, list[StoredRow]] = {}
    for source in (ts.retry, ts.pending):
        for key in source:
            row = rows[key]
            if has is not None and not has(row.fields):
                continue
            if row.group_id is None:
                if drop_stale and policy.is_stale(version, row.v_min):
                    stale.append([row])
                    continue
                yield [row]
                continue
            bucket = buckets.get(row.group_id)
            if bucket is None:
                bucket = buckets[row.group_id] = []
            bucket.append(row)
            if len(bucket) == row.group_size:
                if drop_stale and any(policy.is_stale(version, r.v_min) for r in bucket):
                    stale.append(bucket)
                    continue
                yield bucket


def take(core: QueueCore, ts: TaskState, rows: list[StoredRow], now: float) -> tuple[int, float]:
    """Lease ``rows`` (chosen by :meth:`choose`) to ``ts``; returns the lease id and timeout.

    The caller builds the delivered batch and adds ``len(rows)`` to ``ts.delivered``.
    """
    lease_id = core.next_lease_id
    core.next_lease_id += 1
    timeout = core.config.lease_timeout_s
    retry, pending = ts.retry, ts.pending
    if retry:
        for row in rows:
            if row.key in retry:
                del retry[row.key]
            else:
                del pending[row.key]
    elif len(rows) == len(pending):
        pending.clear()
    else:
        for row in rows:
            del pending[row.key]
    core.leases[lease_id] = Lease(lease_id, ts, rows, now + timeout)
    push_deadline(core, now + timeout, lease_id)
    return lease_id, timeout


def _lease(core: QueueCore, ts: TaskState, fields: tuple[str, ...] | None, rows: list[StoredRow], now: float) -> Batch:
    lease_id, timeout = take(core, ts, rows, now)
    version = core.version
    check = ts.spec.check_staleness
    policy = core.policy
    hist = ts.staleness_hist
    returned = ts.returned
    only = fields[0] if fields is not None and len(fields) == 1 else None
    segments = core.segments > 0
    flagged = 0
    out: list[Row] = []
    append = out.append
    for row in rows:
        v_min = row.v_min
        staleness = version - v_min
        hist[staleness] = hist.get(staleness, 0) + 1
        stale = check and policy.is_stale(version, v_min)
        if stale:
            flagged += 1
        count = 1 + returned.get(row.key, 0) if returned else 1
        rf = row.fields
        if only is not None:
            values = {only: rf[only]}
        elif fields is None:
            values = dict(rf)
        else:
            values = {f: rf[f] for f in fields}
        if segments:
            for name, value in values.items():
                if type(value) is Segment:
                    values[name] = value.data[row.offset]
        append(Row(row.key, values, v_min, row.v_max, row.group_id, row.group_size, row.tags, staleness, stale, count))
    core.counters.flagged += flagged
    ts.delivered += len(out)
    return Batch(ts.spec.name, lease_id, out, timeout, version)
