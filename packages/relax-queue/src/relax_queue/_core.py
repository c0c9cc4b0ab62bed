"""The queue state and its non-blocking operations (callers hold the lock).

``TransferQueue`` (threads) and ``AsyncTransferQueue`` (asyncio) both drive one ``QueueCore``;
the only blocking lives in those facades, which wait on the core's condition or listeners.
"""

from __future__ import annotations

import heapq
import operator
import threading
from collections import OrderedDict
from collections.abc import Callable, Generator, Hashable, Iterable, Iterator, Mapping, Sequence
from itertools import islice, repeat
from operator import attrgetter, contains, ge, is_
from typing import Any, cast

from relax_queue._batchers import Batcher, FixedSizeBatcher
from relax_queue._blocks import SLOW, Range, ack_ranges, choose_ranges, explode, rows_batch
from relax_queue._config import QueueConfig
from relax_queue._errors import (
    AdmissionError,
    FieldTypeError,
    GroupError,
    LeaseError,
    RowTooLargeError,
    UnknownTaskError,
)
from relax_queue._metrics import Counters
from relax_queue._rows import NO_TAGS, Block, Lease, Segment, StoredRow, TaskState, field_value
from relax_queue._sizing import estimate_nbytes
from relax_queue._types import Batch, Key, RequeuedRow, Row, RowInput

__all__ = [
    "NO_TAGS",
    "Lease",
    "QueueCore",
    "Segment",
    "StoredRow",
    "TaskState",
    "as_version",
    "field_value",
    "fields_nbytes",
    "parse_versions",
]

FULL = object()  # sentinel: the row did not fit; wait for capacity
_BULK = 16  # from this many rows on, a C-level pass (map/all) beats a Python loop over them
_row_fields = attrgetter("fields")
_row_key = attrgetter("key")
_row_nbytes = attrgetter("nbytes")


class RetiredKeys:
    """Keys of freed or dropped rows, remembered so a late duplicate put is ignored; bounded.

    Two generations of at most ``keep`` keys each: when the newer one fills up it becomes the older
    one and the oldest generation is forgotten whole. So at least the last ``keep`` retired keys (and
    at most ``2 * keep``) are remembered, and retiring a batch of keys is one C-level set update
    instead of one ordered-dict insert and eviction per key.
    """

    __slots__ = ("keep", "newer", "older")

    def __init__(self, keep: int, keys: Iterable[Key] = ()) -> None:
        self.keep = keep
        self.newer: set[Key] = set()
        self.older: set[Key] = set()
        self.add_many(list(keys))

    def __contains__(self, key: object) -> bool:
        return key in self.newer or key in self.older

    def __len__(self) -> int:
        return len(self.newer) + len(self.older)

    def __iter__(self) -> Iterator[Key]:
        """Older generation first."""
        yield from self.older
        yield from self.newer

    def isdisjoint(self, keys: Iterable[Key]) -> bool:
        """Whether none of ``keys`` is remembered."""
        return self.newer.isdisjoint(keys) and (not self.older or self.older.isdisjoint(keys))

    def add_many(self, keys: list[Key]) -> None:
        """Remember ``keys`` (in order: a generation turns over between two of them if it fills up)."""
        keep = self.keep
        if not keep:
            return
        newer = self.newer
        start = 0
        while len(keys) - start > keep - len(newer):
            stop = start + keep - len(newer)
            newer.update(keys[start:stop])
            start = stop
            self.older, newer = newer, set()
            self.newer = newer
        newer.update(keys[start:] if start else keys)


def as_version(value: Any) -> int | None:
    """``value`` as a policy version (an int >= 0; numpy and other integer types included), or ``None``."""
    if type(value) is int:
        return value if value >= 0 else None
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        return None  # bools are not versions; floats (and numpy floats) have no __index__
    try:
        number = operator.index(value)
    except TypeError:  # numpy.bool_ defines __index__ only to refuse it
        return None
    return number if number >= 0 else None


def parse_versions(key: Key, versions: tuple[int, int] | int | None) -> tuple[int, int]:
    """``(v_min, v_max)`` from a tuple or a single int, validated: ints >= 0 with ``v_min <= v_max``.

    Raises:
        FieldTypeError: naming the row and the value given.
    """
    if isinstance(versions, tuple | list):
        if len(versions) == 2:
            v_min, v_max = as_version(versions[0]), as_version(versions[1])
            if v_min is not None and v_max is not None and v_min <= v_max:
                return v_min, v_max
    else:
        v = as_version(versions)
        if v is not None:
            return v, v
    raise FieldTypeError(
        f"row {key!r}: versions must be an int >= 0 or (v_min, v_max) ints with 0 <= v_min <= v_max, got {versions!r}"
    )


def fields_nbytes(fields: Mapping[str, Any]) -> int:
    """The payload estimate of a row's fields (8 bytes a scalar, :func:`estimate_nbytes` otherwise)."""
    nbytes = 0
    for value in fields.values():
        kind = type(value)
        nbytes += 8 if kind is int or kind is float else estimate_nbytes(value)
    return nbytes


def _has_fields(fields: tuple[str, ...]) -> Callable[[dict[str, Any]], bool]:
    """A test that a row's fields include every one of ``fields`` (non-empty)."""
    if len(fields) == 1:
        name = fields[0]
        return lambda row_fields: name in row_fields
    need = frozenset(fields)
    return lambda row_fields: row_fields.keys() >= need


def check_fields(key: Key, fields: Any) -> dict[str, Any]:
    """Validate a fields mapping (str names) and return it as a dict."""
    if not isinstance(fields, Mapping):
        raise FieldTypeError(
            f"row {key!r}: fields must be a mapping of field name to value, got {type(fields).__name__}"
        )
    for name in fields:
        if not isinstance(name, str):
            raise FieldTypeError(f"row {key!r}: field names must be str, got {name!r}")
    return fields if type(fields) is dict else dict(fields)


class QueueCore:
    """All queue state. Every method expects ``self.lock`` to be held by the caller.

    Callers take ``lock`` itself (``with core.lock``: a C-level enter and exit, where the
    ``Condition`` wrapper's are Python calls) and wait on ``cond``, which is built on that lock.
    """

    def __init__(self, config: QueueConfig) -> None:
        self.config = config
        self.policy = config.staleness
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.waiting = 0  # threads blocked in cond.wait (only they need cond.notify_all)
        self.listeners: set[Callable[[], None]] = set()
        self.closed = False
        self.tasks: dict[str, TaskState] = {s.name: TaskState(s) for s in config.tasks}
        self.rows: dict[Key, StoredRow] = {}
        self.groups: dict[Hashable, dict[Key, StoredRow]] = {}
        self.nbytes = 0
        self.segments = 0  # bulk puts that stored array columns as segments (rows then need resolving)
        # Bulk puts held whole (see _blocks): the blocks in put order, the key of each of their rows
        # not yet freed, and how many those are. ``rows`` holds every other stored row.
        self.blocks: dict[Block, None] = {}
        self.block_keys: dict[Key, Block] = {}
        self.block_rows = 0
        self.version = 0
        self.accepted = 0
        self.running = 0
        self.next_lease_id = 1
        self.leases: dict[int, Lease] = {}
        self.lease_heap: list[tuple[float, int]] = []
        self.retired = RetiredKeys(config.remember_retired)
        self.requeued: list[RequeuedRow] = []
        self.counters = Counters.with_window(config.latency_window)

    # ------------------------------------------------------------------ notification
    def notify(self) -> None:
        """Wake blocked threads and asyncio waiters: the state changed."""
        if self.waiting:  # Condition.notify_all costs a few microseconds even with nobody waiting
            self.cond.notify_all()
        if self.listeners:
            for listener in tuple(self.listeners):
                listener()

    def unblock(self) -> None:
        """Break every block up into stored rows, for the per-row code that follows."""
        if self.blocks:
            explode(self)

    def row_count(self) -> int:
        """Rows stored (blocks' rows included)."""
        return len(self.rows) + self.block_rows

    def task(self, name: str) -> TaskState:
        """The state of task ``name``; unknown names raise :class:`UnknownTaskError`."""
        try:
            return self.tasks[name]
        except KeyError:
            raise UnknownTaskError(f"unknown task {name!r}; registered tasks are {list(self.tasks)}") from None

    # ------------------------------------------------------------------ put
    def put_row(
        self,
        key: Key,
        fields: Mapping[str, Any],
        versions: tuple[int, int] | int | None,
        group_id: Hashable | None,
        group_size: int | None,
        tags: Mapping[str, int | float | str] | None,
        admitted: bool,
    ) -> object:
        """Insert a row or add its missing fields; returns ``FULL`` when a new row must wait."""
        outcome = self._insert(key, fields, versions, group_id, group_size, tags)
        if outcome is FULL:
            return FULL
        self._commit([key] if outcome else [], 1 if admitted else 0)
        return None

    def put_rows(self, rows: Sequence[RowInput], start: int, admitted: bool, inserted: list[Key]) -> int:
        """:meth:`put_row` for ``rows[start:]`` in order, with the per-task bookkeeping done once.

        Args:
            rows: the rows of the call.
            start: the first row not handled yet.
            admitted: each handled row settles one admission.
            inserted: the keys of newly stored rows are appended here (not those only given fields).

        Returns:
            The index of the first row that must wait for capacity (``len(rows)``: all handled).
            Rows before a row that raises stay stored, and waiting readers are woken for them.
        """
        new: list[Key] = []
        handled = start
        insert = self._insert
        try:
            for i in range(start, len(rows)):
                r = rows[i]
                if type(r) is not RowInput and not isinstance(r, RowInput):
                    raise FieldTypeError(f"put_many expects RowInput items, got {type(r).__name__} at index {i}")
                outcome = insert(r.key, r.fields, r.versions, r.group_id, r.group_size, r.tags)
                if outcome is FULL:
                    break
                if outcome:
                    new.append(r.key)
                handled = i + 1
        except BaseException:
            self.commit_partial(new, handled - start if admitted else 0, inserted)
            raise
        self._commit(new, handled - start if admitted else 0)
        inserted.extend(new)
        return handled

    def commit_partial(self, new: list[Key], arrived: int, inserted: list[Key]) -> None:
        """Commit what a call stored before it failed, and wake readers: those rows are deliverable."""
        self._commit(new, arrived)
        inserted.extend(new)
        self.notify()

    def _insert(
        self,
        key: Key,
        fields: Mapping[str, Any],
        versions: tuple[int, int] | int | None,
        group_id: Hashable | None,
        group_size: int | None,
        tags: Mapping[str, int | float | str] | None,
    ) -> object:
        """Store a new row (``True``; the caller commits its key), add a known row's missing fields or
        ignore a retired key (``False``), or ``FULL``."""
        if self.blocks:  # a row put one at a time comes after every block row: break the blocks up
            explode(self)
        row = self.rows.get(key)
        if row is not None:
            self._check_same_row(row, versions, group_id, group_size)
            self._add_missing(row, check_fields(key, fields))
            return False
        if key in self.retired:
            self.counters.duplicate_puts += 1
            return False
        if type(fields) is not dict:
            fields = check_fields(key, fields)
        for name in fields:
            if type(name) is not str:
                raise FieldTypeError(f"row {key!r}: field names must be str, got {name!r}")
        fields = fields.copy()  # the caller's dict stays theirs; add_fields must not change it
        if type(versions) is int and versions >= 0:
            v_min = v_max = versions
        elif versions is None:
            v_min = v_max = 0
        else:
            v_min, v_max = parse_versions(key, versions)
        if not tags:
            tags = NO_TAGS
        elif not isinstance(tags, Mapping):
            raise FieldTypeError(f"row {key!r}: tags must be a mapping, got {type(tags).__name__}")
        else:
            tags = dict(tags)
        members = None if group_id is None and group_size is None else self._check_group(key, group_id, group_size)
        cap = self.config.capacity
        nbytes = 0
        if cap.max_bytes is not None:  # sizing only serves the byte bound; unbounded queues skip it
            nbytes = fields_nbytes(fields)
            if nbytes > cap.max_bytes:
                raise RowTooLargeError(f"row {key!r} is {nbytes} bytes, larger than max_bytes={cap.max_bytes}")
            if self.nbytes + nbytes > cap.max_bytes:
                return FULL
        if cap.max_rows is not None and len(self.rows) >= cap.max_rows:
            return FULL
        row = StoredRow(key, fields, v_min, v_max, group_id, group_size, tags, nbytes, len(self.tasks))
        self.rows[key] = row
        if members is not None:
            members[key] = row
        self.nbytes += nbytes
        return True

    def _check_same_row(
        self, row: StoredRow, versions: tuple[int, int] | int | None, group_id: Hashable | None, group_size: int | None
    ) -> None:
        """Count a put of a stored key that gives other versions or another group than the stored row.

        The first put's versions and group stay (the row may be leased already); given versions must
        still be valid. ``None``, the default, gives nothing: a later stage may put only its fields.
        """
        if versions is None:
            same = True
        elif type(versions) is int:
            same = versions == row.v_min == row.v_max
            if versions < 0:
                parse_versions(row.key, versions)  # raises: a bad version is an error in every form
        else:
            same = parse_versions(row.key, versions) == (row.v_min, row.v_max)
        if group_id is not None or group_size is not None:
            same = same and (group_id, group_size) == (row.group_id, row.group_size)
        if not same:
            self.counters.conflicting_puts += 1

    def _commit(self, new: list[Key], arrived: int, queue: bool = True) -> None:
        """Queue the ``new`` rows' keys for every task (in order; not for a block's rows: ``queue=False``)
        and settle ``arrived`` admissions."""
        if new:
            for ts in self.tasks.values() if queue else ():
                pending = ts.pending
                if len(new) == 1:
                    pending[new[0]] = None
                elif not pending:
                    ts.pending = OrderedDict.fromkeys(new)
                else:  # a loop: OrderedDict.update takes a slow generic path (≈ 2.5x the time)
                    for key in new:
                        pending[key] = None
            self.counters.puts += len(new)
            self.accepted += len(new)
        if arrived:
            # Each admitted row (new, a regenerated duplicate, or a late one) ends one running admission.
            matched = min(arrived, self.running)
            self.running -= matched
            self.counters.admission_unmatched += arrived - matched

    def _check_group(self, key: Key, group_id: Hashable | None, group_size: int | None) -> dict[Key, StoredRow] | None:
        if group_id is None:
            if group_size is not None:
                raise GroupError(f"row {key!r}: group_size={group_size} given without group_id")
            return None
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
            raise GroupError(f"row {key!r}: group {group_id!r} needs a positive int group_size, got {group_size!r}")
        members = self.groups.get(group_id)
        if members is None:
            members = self.groups[group_id] = {}
        elif members:
            size = next(iter(members.values())).group_size
            if size != group_size:
                raise GroupError(f"row {key!r}: group {group_id!r} has group_size={size}, this row says {group_size}")
            if len(members) >= group_size:
                raise GroupError(f"row {key!r}: group {group_id!r} already has its {group_size} rows")
        max_rows = self.config.capacity.max_rows
        if max_rows is not None and group_size > max_rows:
            raise GroupError(
                f"row {key!r}: group {group_id!r} of group_size={group_size} can never be complete in a queue "
                f"of max_rows={max_rows} (groups are delivered whole)"
            )
        return members

    def group_deadlock(self) -> str | None:
        """Why no stored row can ever be delivered while the queue is full, or ``None``.

        Readers take whole groups only, so when every stored row belongs to an incomplete group no
        lease can free room, and the rows that would complete those groups can never be stored.
        """
        groups = self.groups
        if not groups:
            return None
        held = 0
        for members in groups.values():
            if not members:
                continue  # registered by a row that did not fit
            size = next(iter(members.values())).group_size
            if size is None or len(members) >= size:
                return None  # a complete group can be delivered and acked
            held += len(members)
        if held != self.row_count():
            return None  # an ungrouped row can still be delivered
        shown = ", ".join(repr(g) for g in islice(groups, 5))
        return (
            f"group deadlock: all {held} stored rows belong to {len(groups)} incomplete groups ({shown}"
            f"{', ...' if len(groups) > 5 else ''}), so no group can complete and no row can be freed; "
            "raise max_rows/max_bytes above (open groups x group_size) or put each group whole"
        )

    def _add_missing(self, row: StoredRow, fields: dict[str, Any]) -> None:
        added = False
        bounded = self.config.capacity.max_bytes is not None
        for name, value in fields.items():
            if name not in row.fields:
                row.fields[name] = value
                if bounded:
                    size = estimate_nbytes(value)
                    row.nbytes += size
                    self.nbytes += size
                added = True
        if added:
            self.counters.fields_added += 1
        else:
            self.counters.duplicate_puts += 1

    def add_fields(self, key: Key, fields: Mapping[str, Any]) -> bool:
        """Add fields to a stored row; ``False`` (counted) when the key is not stored."""
        checked = check_fields(key, fields)  # malformed input is an error whether or not the key is stored
        if key in self.block_keys:
            explode(self)
        row = self.rows.get(key)
        if row is None:
            self.counters.add_fields_unknown_key += 1
            return False
        self._add_missing(row, checked)
        return True

    # ------------------------------------------------------------------ get
    def ready(self, task: str, fields: tuple[str, ...] | None) -> int:
        """Rows ``task`` has not leased or consumed yet that carry every one of ``fields``."""
        ts = self.task(task)
        self.unblock()
        rows = self.rows
        if not fields:
            return len(ts.pending) + len(ts.retry)
        return sum(
            1 for source in (ts.retry, ts.pending) for key in source if all(f in rows[key].fields for f in fields)
        )

    def try_get(
        self, task: str, fields: tuple[str, ...] | None, n: int | None, batcher: Batcher, now: float
    ) -> Batch | None:
        """Lease the batch the batcher picks, or ``None`` when it wants to wait."""
        ts = self.tasks.get(task) or self.task(task)
        if self.blocks:
            ranges = choose_ranges(self, ts, fields, n, batcher, now)
            if ranges is not SLOW:
                return None if ranges is None else rows_batch(self, ts, fields, cast("list[Range]", ranges), now)
        rows = self.choose(ts, fields, n, batcher, now)
        return None if rows is None else self._lease(ts, fields, rows, now)

    def choose(
        self, ts: TaskState, fields: tuple[str, ...] | None, n: int | None, batcher: Batcher, now: float
    ) -> list[StoredRow] | None:
        """The rows of the next batch of ``ts`` (whole groups, none stale unless flagged), or ``None``.

        Expires due leases and removes the stale rows it meets first; leases nothing.
        """
        if self.blocks:
            explode(self)
        if self.lease_heap and self.lease_heap[0][0] <= now:
            self.expire(now)
        if type(batcher) is FixedSizeBatcher and not self.groups and not self._drops_stale(ts):
            # Every unit is one row and none is removed as stale: the batch is the first ready rows.
            target = n or batcher.size
            rows = self._ready_rows(ts, fields, target)
            if len(rows) < target and not (batcher.partial and rows):
                return None
            return rows
        stale: list[list[StoredRow]] = []
        units = self._units(ts, fields, stale)
        try:
            chosen = batcher.select(units, n)
        finally:
            units.close()
        if stale:
            self._remove_stale(stale)
        if not chosen:
            return None
        # The batcher hands back units of the rows it was given.
        return cast("list[StoredRow]", [row for unit in chosen for row in unit])

    def _drops_stale(self, ts: TaskState) -> bool:
        """Whether stale rows are removed (not only flagged) when ``ts`` consumes them."""
        return ts.spec.check_staleness and self.policy.on_stale != "flag"

    def _ready_rows(self, ts: TaskState, fields: tuple[str, ...] | None, limit: int) -> list[StoredRow]:
        """Up to ``limit`` rows of ``ts`` in delivery order (redeliveries first) carrying all ``fields``."""
        rows = self.rows
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
            if limit - len(out) >= _BULK:
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
        self, ts: TaskState, fields: tuple[str, ...] | None, stale: list[list[StoredRow]]
    ) -> Generator[list[StoredRow], None, None]:
        rows = self.rows
        policy = self.policy
        version = self.version
        drop_stale = self._drops_stale(ts)
        has = _has_fields(fields) if fields else None
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

    def take(self, ts: TaskState, rows: list[StoredRow], now: float) -> tuple[int, float]:
        """Lease ``rows`` (chosen by :meth:`choose`) to ``ts``; returns the lease id and timeout.

        The caller builds the delivered batch and adds ``len(rows)`` to ``ts.delivered``.
        """
        lease_id = self.next_lease_id
        self.next_lease_id += 1
        timeout = self.config.lease_timeout_s
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
        self.leases[lease_id] = Lease(lease_id, ts, rows, now + timeout)
        self._push_deadline(now + timeout, lease_id)
        return lease_id, timeout

    def _lease(self, ts: TaskState, fields: tuple[str, ...] | None, rows: list[StoredRow], now: float) -> Batch:
        lease_id, timeout = self.take(ts, rows, now)
        version = self.version
        check = ts.spec.check_staleness
        policy = self.policy
        hist = ts.staleness_hist
        returned = ts.returned
        only = fields[0] if fields is not None and len(fields) == 1 else None
        segments = self.segments > 0
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
            append(
                Row(row.key, values, v_min, row.v_max, row.group_id, row.group_size, row.tags, staleness, stale, count)
            )
        self.counters.flagged += flagged
        ts.delivered += len(out)
        return Batch(ts.spec.name, lease_id, out, timeout, version)

    # ------------------------------------------------------------------ leases
    def _pop_lease(self, lease_id: int, action: str) -> Lease:
        held = self.leases.get(lease_id)
        if held is not None and held.ranges is not None:
            explode(self)  # fills the lease's rows
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            raise LeaseError(f"cannot {action} lease {lease_id}: it is unknown, already settled, or expired")
        if lease.on_settle is not None:
            lease.on_settle()
        return lease

    def ack(self, lease_id: int) -> int:
        """Consume the lease's rows for its task; returns how many rows were freed entirely."""
        held = self.leases.get(lease_id)
        if held is not None and held.ranges is not None:
            freed = ack_ranges(self, held)  # block rows acked in order: no per-row work
            if freed is not None:
                return freed
        lease = self._pop_lease(lease_id, "ack")
        rows = self.rows
        returned = lease.task.returned
        leased = lease.rows
        done: list[StoredRow] = []
        append = done.append
        acked = len(leased)
        if len(leased) >= _BULK and not returned and all(map(is_, map(rows.get, map(_row_key, leased)), leased)):
            # The usual case (none dropped or returned meanwhile), checked in C above.
            if len(self.tasks) == 1:
                done = leased  # this task was the only one each row waited for
            else:
                for row in leased:
                    left = row.pending_tasks - 1
                    row.pending_tasks = left
                    if not left:
                        append(row)
        else:
            for row in leased:
                if rows.get(row.key) is not row:  # dropped or requeued meanwhile: not consumed by this ack
                    acked -= 1
                    continue
                if returned:
                    returned.pop(row.key, None)
                row.pending_tasks -= 1
                if row.pending_tasks == 0:
                    append(row)
        if done:
            self._remove_many(done, retire=True, consumed=True)
        lease.task.acked += acked
        self.counters.freed += len(done)
        return len(done)

    def nack(self, lease_id: int) -> None:
        """Return the lease's rows to its task for redelivery (first in line)."""
        lease = self._pop_lease(lease_id, "nack")
        self.counters.nacks += 1
        self._redeliver(lease)

    def renew(self, lease_id: int, now: float, timeout_s: float | None) -> float:
        """Extend a lease to ``now + timeout_s`` (default the lease timeout); returns the new deadline."""
        lease = self.leases.get(lease_id)
        if lease is None:
            raise LeaseError(f"cannot renew lease {lease_id}: it is unknown, already settled, or expired")
        lease.deadline = now + (timeout_s if timeout_s is not None else self.config.lease_timeout_s)
        self._push_deadline(lease.deadline, lease_id)
        return lease.deadline

    def _push_deadline(self, deadline: float, lease_id: int) -> None:
        """Track a lease deadline. Settled and renewed leases leave stale entries behind until their
        deadline passes; rebuild the heap from the live leases when those outnumber them, so that it
        stays O(live leases) at any ack rate."""
        heap = self.lease_heap
        if len(heap) > 2 * len(self.leases) + 64:
            heap[:] = [(lease.deadline, lid) for lid, lease in self.leases.items() if lid != lease_id]
            heapq.heapify(heap)
        heapq.heappush(heap, (deadline, lease_id))

    def _redeliver(self, lease: Lease) -> None:
        rows = self.rows
        retry = lease.task.retry
        returned = lease.task.returned
        for row in lease.rows:
            if rows.get(row.key) is row:
                retry[row.key] = None
                returned[row.key] = returned.get(row.key, 0) + 1
                self.counters.redeliveries += 1

    def expire(self, now: float) -> bool:
        """Redeliver the rows of every lease past its deadline; ``True`` if any expired."""
        heap = self.lease_heap
        expired = False
        while heap and heap[0][0] <= now:
            deadline, lease_id = heapq.heappop(heap)
            lease = self.leases.get(lease_id)
            if lease is None or lease.deadline != deadline:  # settled, or renewed (a newer entry exists)
                continue
            self._pop_lease(lease_id, "expire")
            self.counters.expired_leases += 1
            self._redeliver(lease)
            expired = True
        if expired:
            self.notify()
        return expired

    def measure_bytes(self) -> int:
        """The stored payload estimate, measured now (unbounded queues keep no running byte count)."""
        self.unblock()
        return sum(fields_nbytes(row.fields) for row in self.rows.values())

    def live_rows(self, lease: Lease) -> list[StoredRow]:
        """The rows of ``lease`` still stored as leased (not dropped, requeued or re-put since)."""
        self.unblock()
        rows = self.rows
        return [row for row in lease.rows if rows.get(row.key) is row]

    def next_deadline(self) -> float | None:
        """The earliest lease deadline (blocked waiters wake then to expire it)."""
        return self.lease_heap[0][0] if self.lease_heap else None

    # ------------------------------------------------------------------ removal
    def _remove(self, row: StoredRow, retire: bool) -> None:
        self._remove_many([row], retire)

    def _remove_many(self, removed: list[StoredRow], retire: bool, consumed: bool = False) -> None:
        """Forget stored rows (each at most once), optionally retiring their keys in order.

        ``consumed``: every task acked these rows, so no task's pending or retry queue holds them.
        """
        rows = self.rows
        # A queue empty now stays empty while rows are only removed: skip it.
        queues: list[OrderedDict[Key, None] | dict[Key, int]] = []
        for ts in self.tasks.values():
            if ts.returned:
                queues.append(ts.returned)
            if consumed:
                continue
            if ts.pending:
                queues.append(ts.pending)
            if ts.retry:
                queues.append(ts.retry)
        if len(removed) == 1:
            keys = [removed[0].key]
            del rows[keys[0]]
            self.nbytes -= removed[0].nbytes
        else:
            keys = list(map(_row_key, removed))
            if len(keys) == len(rows):  # every stored row goes (each is removed at most once)
                rows.clear()
            else:
                for key in keys:
                    del rows[key]
            self.nbytes -= sum(map(_row_nbytes, removed))
        for q in queues:
            for key in keys:
                q.pop(key, None)
        groups = self.groups
        if groups:
            for row in removed:
                if row.group_id is not None:
                    members = groups.get(row.group_id)
                    if members is not None:
                        members.pop(row.key, None)
                        if not members:
                            del groups[row.group_id]
        if retire:
            self.retired.add_many(keys)

    def _remove_stale(self, units: list[list[StoredRow]]) -> None:
        action = self.policy.on_stale
        for unit in units:
            for row in unit:
                if self.rows.get(row.key) is not row:
                    continue
                self._remove(row, retire=action == "drop")
                self.accepted = max(0, self.accepted - 1)  # its admission slot is free again
                if action == "requeue":
                    self.counters.requeues += 1
                    self.requeued.append(
                        RequeuedRow(row.key, row.group_id, row.group_size, row.tags, row.v_min, self.version)
                    )
                else:
                    self.counters.drops += 1
        self.notify()

    # ------------------------------------------------------------------ admission
    def try_admit(self, n: int) -> int:
        """Reserve up to ``n`` sample starts allowed by the staleness policy; returns the count."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise AdmissionError(f"admit(n) needs an int n >= 0, got {n!r}")
        capacity = self.policy.admission_capacity(self.version, self.accepted, self.running)
        granted = n if capacity is None else max(0, min(n, capacity))
        self.running += granted
        self.counters.admission_granted += granted
        return granted

    def release_admission(self, n: int, failed: bool) -> None:
        """Return ``n`` admissions that will not produce a row (unused, or a failed sample)."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise AdmissionError(f"release_admission(n) needs an int n >= 0, got {n!r}")
        matched = min(n, self.running)
        self.counters.admission_unmatched += n - matched
        self.running -= matched
        if failed:
            self.counters.admission_failed += n
        else:
            self.counters.admission_released += n
        self.notify()

    def refund_admission(self, n: int) -> None:
        """``n`` consumed rows did not advance the version: their admission slots are free again."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise AdmissionError(f"refund_admission(n) needs an int n >= 0, got {n!r}")
        self.accepted = max(0, self.accepted - n)
        self.counters.admission_refunded += n
        self.notify()

    def admission_capacity(self) -> int | None:
        """Samples that may start now (``None``: unlimited)."""
        return self.policy.admission_capacity(self.version, self.accepted, self.running)
