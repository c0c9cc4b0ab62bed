"""Rows of a bulk ``put_columns`` held as one :class:`Block`: stored, leased, delivered and acked
in whole ranges, with no per-row object (callers hold the lock).

A block is a faster way to hold exactly the state a row-by-row put would have built, for the
usual pipeline: a reader with a ``FixedSizeBatcher`` taking the rows in order and acking its
batches in order. Blocks only ever hold the newest rows (a put of a single row first breaks every
block up), so a task's pending rows are its ordinary pending rows, then the untaken rows of each
block in put order. Whatever a block cannot answer in bulk (a field added, a nack or expiry, an ack
out of order, a grouped, filtering or replicated reader, a snapshot, metrics) first calls
:func:`explode`, which turns every block into the stored rows, task queues and leases the
row-by-row path would have made; the code that follows is the ordinary per-row code.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable
from itertools import chain, repeat
from operator import sub
from typing import TYPE_CHECKING, Any

from relax_queue._batchers import Batcher, FixedSizeBatcher
from relax_queue._rows import NO_TAGS, Block, Lease, Segment, StoredRow, TaskState
from relax_queue._types import Batch, ColumnBatch, Key, Tags

if TYPE_CHECKING:
    from relax_queue._core import QueueCore

__all__ = [
    "SLOW",
    "Range",
    "ack_ranges",
    "choose_ranges",
    "columns_batch",
    "explode",
    "rows_batch",
    "staleness_of",
    "store",
]

Range = tuple[Block, int, int]  # rows [start, stop) of a block
SLOW = object()  # sentinel: the blocks cannot answer this get in bulk; break them up and take the per-row path


def store(
    core: QueueCore,
    keys: list[Key],
    unique: set[Key],
    names: tuple[str, ...],
    columns: list[Any],
    v_min: int | list[int],
    v_max: int | list[int],
    tags: list[Tags] | None,
    nbytes: int | list[int],
) -> None:
    """Hold new, ungrouped rows as one block (``unique``: ``keys`` as a set; the caller checked them unknown)."""
    block = Block(keys, names, columns, v_min, v_max, tags, nbytes, core.tasks)
    core.blocks[block] = None
    index = dict.fromkeys(unique, block)  # built in C from the set's stored hashes: no per-row object
    if core.block_keys:
        core.block_keys.update(index)
    else:
        core.block_keys = index
    core.block_rows += len(keys)


def explode(core: QueueCore) -> None:
    """Turn every block into the stored rows, task queues and leases a row-by-row put would have made.

    Built with C-level passes (``map`` over the block's columns), as a bulk put of stored rows is.
    """
    rows = core.rows
    made: dict[Block, list[StoredRow]] = {}
    for block in core.blocks:
        first, count = block.freed, len(block.keys) - block.freed
        keys = block.keys[first:] if first else block.keys
        names, columns = block.names, block.columns
        fields: list[dict[str, Any]]
        if not names:
            fields = [{} for _ in range(count)]
        elif all(type(column) is Segment for column in columns):  # copies of one dict of segments, in C
            fields = list(map(dict.copy, repeat(dict(zip(names, columns, strict=True)), count)))
        else:
            values = [repeat(c, count) if type(c) is Segment else c[first:] for c in columns]
            fields = [dict(zip(names, row, strict=True)) for row in zip(*values, strict=True)]
        # Tasks that have not acked each row yet: all of them, less those whose acks passed it.
        waiting = [len(block.acked)] * count
        for upto in block.acked.values():
            if upto > first:
                waiting[: upto - first] = [w - 1 for w in waiting[: upto - first]]
        stored = list(
            map(
                StoredRow,
                keys,
                fields,
                _per_row(block.v_min, first),
                _per_row(block.v_max, first),
                repeat(None),
                repeat(None),
                repeat(NO_TAGS) if block.tags is None else block.tags[first:],
                _per_row(block.nbytes, first),
                waiting,
                range(first, len(block.keys)),
            )
        )
        rows.update(zip(keys, stored, strict=True))
        made[block] = stored
        for name, ts in core.tasks.items():
            queued = block.keys[block.taken[name] :]
            if not ts.pending:
                ts.pending = OrderedDict.fromkeys(queued)
            else:
                pending = ts.pending
                for key in queued:
                    pending[key] = None
    for lease in core.leases.values():
        if lease.ranges is not None:
            lease.rows = [row for b, start, stop in lease.ranges for row in made[b][start - b.freed : stop - b.freed]]
            lease.ranges = None
    core.blocks.clear()
    core.block_keys.clear()
    core.block_rows = 0


def _per_row(column: int | list[Any], first: int) -> Iterable[Any]:
    """A block's per-row metadata from row ``first`` on: its one value repeated, or the list's tail."""
    return repeat(column) if type(column) is int else column[first:]  # type: ignore[index]


def choose_ranges(
    core: QueueCore, ts: TaskState, fields: tuple[str, ...] | None, n: int | None, batcher: Batcher, now: float
) -> list[Range] | object | None:
    """The block rows of the next batch of ``ts`` (``None``: wait), or :data:`SLOW`.

    Bulk only when the batch is the first ``n`` ready rows (a ``FixedSizeBatcher``, no groups, no
    stale rows removed) and those are all block rows carrying the reader's fields: the task has no
    ordinary rows pending or to redeliver.
    """
    if (
        type(batcher) is not FixedSizeBatcher
        or core.groups
        or ts.retry
        or ts.pending
        or (ts.spec.check_staleness and core.policy.on_stale != "flag")
    ):
        return SLOW
    if core.lease_heap and core.lease_heap[0][0] <= now:
        core.expire(now)  # an expired lease of block rows breaks the blocks up
        if not core.blocks or ts.retry or ts.pending:
            return SLOW
    target = n or batcher.size
    name = ts.spec.name
    ranges: list[Range] = []
    got = 0
    names: tuple[str, ...] | None = None
    for block in core.blocks:
        start, stop = block.taken[name], len(block.keys)
        if start == stop:
            continue
        if fields is None:
            if names is None:
                names = block.names
            elif block.names != names and set(block.names) != set(names):
                return SLOW  # rows with other fields: the per-row path names them in its error
        elif not all(f in block.names for f in fields):
            return SLOW  # its rows wait for fields: the per-row path skips them
        take = min(stop - start, target - got)
        ranges.append((block, start, start + take))
        got += take
        if got == target:
            break
    if got < target and not (batcher.partial and got):
        return None
    return ranges


def _lease(core: QueueCore, ts: TaskState, ranges: list[Range], now: float) -> tuple[int, float]:
    lease_id = core.next_lease_id
    core.next_lease_id += 1
    timeout = core.config.lease_timeout_s
    core.leases[lease_id] = Lease(lease_id, ts, [], now + timeout, ranges)
    core.push_deadline(now + timeout, lease_id)
    name = ts.spec.name
    for block, _, stop in ranges:
        block.taken[name] = stop
    return lease_id, timeout


def _meta(ranges: list[Range], values: list[int | list[Any] | None], fill: Any) -> list[Any]:
    """A per-row metadata column over ``ranges``: each block's one value repeated, or its slice."""
    parts = [
        [fill if v is None else v] * (stop - start) if v is None or type(v) is int else v[start:stop]  # type: ignore[index]
        for v, (_, start, stop) in zip(values, ranges, strict=True)
    ]
    return parts[0] if len(parts) == 1 else list(chain.from_iterable(parts))


def _column(ranges: list[Range], name: str) -> Any:
    """A delivered field: a slice of the block's array (or list) when the batch is one range of one
    block, else one value per row (as the per-row path delivers rows of several puts)."""
    parts = []
    for block, start, stop in ranges:
        column = block.columns[block.names.index(name)]
        if type(column) is Segment:
            data = column.data
            if len(ranges) == 1:
                return data[start:stop]
            parts.append(list(map(data.__getitem__, range(start, stop))))
        else:
            parts.append(column[start:stop])
    return parts[0] if len(parts) == 1 else list(chain.from_iterable(parts))


def staleness_of(core: QueueCore, ts: TaskState, v_min: list[int]) -> tuple[list[int], list[bool]]:
    """Each row's staleness and stale flag at delivery to ``ts``; counts them in its histogram and ``flagged``."""
    count = len(v_min)
    version = core.version
    hist = ts.staleness_hist
    if count and v_min.count(v_min[0]) == count:  # the usual case: one version for the whole batch
        staleness = [version - v_min[0]] * count
        hist[staleness[0]] = hist.get(staleness[0], 0) + count
    else:
        staleness = list(map(sub, repeat(version), v_min))
        for age, rows_of_age in Counter(staleness).items():
            hist[age] = hist.get(age, 0) + rows_of_age
    if ts.spec.check_staleness:
        verdict = {v: core.policy.is_stale(version, v) for v in set(v_min)}
        stale = list(map(verdict.__getitem__, v_min))
        core.counters.flagged += sum(stale)
    else:
        stale = [False] * count
    return staleness, stale


def columns_batch(
    core: QueueCore, ts: TaskState, fields: tuple[str, ...] | None, ranges: list[Range], now: float
) -> ColumnBatch:
    """Lease ``ranges`` to ``ts`` and deliver them as columns."""
    names = fields if fields is not None else (ranges[0][0].names if ranges else ())
    lease_id, timeout = _lease(core, ts, ranges, now)
    blocks = [block for block, _, _ in ranges]
    keys = _meta(ranges, [block.keys for block in blocks], None)
    v_min = _meta(ranges, [block.v_min for block in blocks], None)
    staleness, stale = staleness_of(core, ts, v_min)
    count = len(keys)
    nothing: list[Hashable | None] = [None] * count
    ts.delivered += count
    return ColumnBatch(
        ts.spec.name,
        lease_id,
        keys,
        {name: _column(ranges, name) for name in names},
        v_min,
        _meta(ranges, [block.v_max for block in blocks], None),
        nothing,
        [None] * count,
        _meta(ranges, [block.tags for block in blocks], NO_TAGS),
        staleness,
        stale,
        [1] * count,  # block rows were never delivered before: a nack or expiry breaks the blocks up
        timeout,
        core.version,
    )


def rows_batch(
    core: QueueCore, ts: TaskState, fields: tuple[str, ...] | None, ranges: list[Range], now: float
) -> Batch:
    """Lease ``ranges`` to ``ts`` and deliver them as rows."""
    return columns_batch(core, ts, fields, ranges, now).to_batch()


def ack_ranges(core: QueueCore, lease: Lease) -> int | None:
    """Ack a lease of block rows taken in order; returns the rows freed entirely, or ``None`` when it
    is acked out of order (nothing done: the caller breaks the blocks up and acks the rows)."""
    ranges = lease.ranges
    name = lease.task.spec.name
    if ranges is None or any(block.acked[name] != start for block, start, _ in ranges):
        return None
    del core.leases[lease.lease_id]
    freed = 0
    for block, start, stop in ranges:
        block.acked[name] = stop
        lowest = min(block.acked.values())  # rows every task acked are freed
        if lowest > block.freed:
            freed += _free(core, block, lowest)
        lease.task.acked += stop - start
    core.counters.freed += freed
    return freed


def _free(core: QueueCore, block: Block, upto: int) -> int:
    """Forget rows ``[freed, upto)`` of ``block`` (consumed by every task) and retire their keys in order."""
    keys = block.keys[block.freed : upto] if block.freed or upto < len(block.keys) else block.keys
    index = core.block_keys
    if len(keys) == len(index):
        index.clear()  # the usual case: these were the only block rows
    else:
        for key in keys:
            del index[key]
    nbytes = block.nbytes
    core.nbytes -= nbytes * len(keys) if type(nbytes) is int else sum(nbytes[block.freed : upto])  # type: ignore[index]
    core.retired.add_many(keys)
    core.block_rows -= len(keys)
    block.freed = upto
    if upto == len(block.keys):
        del core.blocks[block]
    return len(keys)
