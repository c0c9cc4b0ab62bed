"""The queue state and its non-blocking operations (callers hold the lock).

``TransferQueue`` (threads) and ``AsyncTransferQueue`` (asyncio) both drive one ``QueueCore``;
the only blocking lives in those facades, which wait on the core's condition or listeners. This
module holds the state, the put path, removal and admission; choosing and leasing batches live in
``_delivery``, settling leases in ``_leasing``, validation of put arguments in ``_fields``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from itertools import islice
from operator import attrgetter
from typing import Any

from relax_queue import _delivery, _leasing
from relax_queue._blocks import explode
from relax_queue._config import QueueConfig
from relax_queue._errors import AdmissionError, FieldTypeError, GroupError, RowTooLargeError, UnknownTaskError
from relax_queue._fields import as_version, check_fields, fields_nbytes, parse_versions
from relax_queue._metrics import Counters
from relax_queue._rows import NO_TAGS, Block, Lease, RetiredKeys, Segment, StoredRow, TaskState, field_value
from relax_queue._types import Key, RequeuedRow, RowInput

__all__ = [
    "FULL",
    "NO_TAGS",
    "Lease",
    "QueueCore",
    "RetiredKeys",
    "Segment",
    "StoredRow",
    "TaskState",
    "as_version",
    "field_value",
    "fields_nbytes",
    "parse_versions",
]

FULL = object()  # sentinel: the row did not fit; wait for capacity
_row_key = attrgetter("key")
_row_nbytes = attrgetter("nbytes")


def _largest(fields: Mapping[str, Any]) -> str:
    """``"; its largest field is 'name' (N bytes)"`` of a row too large for the byte bound."""
    name, size = max(((n, fields_nbytes({n: v})) for n, v in fields.items()), key=lambda item: item[1])
    return f"; its largest field is {name!r} ({size} bytes)"


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
        self._commit([key] if outcome else [], admitted, 1)
        return None

    def put_rows(self, rows: Sequence[RowInput], start: int, admitted: bool, inserted: list[Key]) -> int:
        """:meth:`put_row` for ``rows[start:]`` in order, with the per-task bookkeeping done once.

        Args:
            rows: the rows of the call.
            start: the first row not handled yet.
            admitted: each newly stored row settles one admission (see :meth:`_commit`).
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
            self.commit_partial(new, admitted, handled - start, inserted)
            raise
        self._commit(new, admitted, handled - start)
        inserted.extend(new)
        return handled

    def commit_partial(self, new: list[Key], admitted: bool, handled: int, inserted: list[Key]) -> None:
        """Commit what a call stored before it failed, and wake readers: those rows are deliverable."""
        self._commit(new, admitted, handled)
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
                raise RowTooLargeError(
                    f"row {key!r} is {nbytes} bytes, larger than max_bytes={cap.max_bytes}{_largest(fields)}"
                )
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

    def _commit(self, new: list[Key], admitted: bool, handled: int, queue: bool = True) -> None:
        """Queue the ``new`` rows' keys for every task (in order; not for a block's rows: ``queue=False``)
        and, for an ``admitted`` put of ``handled`` rows, settle one admission per new row.

        An admission belongs to a sample, not to an attempt at producing it: a put that stores nothing (the key
        is stored or retired already: a producer's retry, or a regeneration after a restore) settles nothing,
        because the put that stored the row settled its admission. Settling again would undercount the samples
        in flight and let the staleness bound over-grant (at τ = 0, one group more than the synchronous trainer).
        """
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
        if admitted:
            self.counters.admission_duplicates += handled - len(new)
            matched = min(len(new), self.running)
            self.running -= matched
            self.counters.admission_unmatched += len(new) - matched

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
        new = {name: value for name, value in fields.items() if name not in row.fields}
        limit = self.config.capacity.max_bytes
        if limit is not None and new:
            size = fields_nbytes(new)
            if row.nbytes + size > limit:  # checked before any field is added: the row stays as it was
                raise RowTooLargeError(
                    f"row {row.key!r}: adding {size} bytes of fields to its {row.nbytes} would make it larger than "
                    f"max_bytes={limit}{_largest(new)}"
                )
            row.nbytes += size
            self.nbytes += size
        row.fields.update(new)
        added = bool(new)
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

    # ------------------------------------------------------------------ get and leases
    # Delivery (``_delivery``) and lease settling (``_leasing``) are functions over this state;
    # bound here, callers keep calling them as methods of the core.
    ready = _delivery.ready
    try_get = _delivery.try_get
    choose = _delivery.choose
    take = _delivery.take
    ack = _leasing.ack
    nack = _leasing.nack
    renew = _leasing.renew
    expire = _leasing.expire
    live_rows = _leasing.live_rows
    next_deadline = _leasing.next_deadline
    push_deadline = _leasing.push_deadline

    # ------------------------------------------------------------------ sizing
    def measure_bytes(self) -> int:
        """The stored payload estimate, measured now (unbounded queues keep no running byte count)."""
        self.unblock()
        return sum(fields_nbytes(row.fields) for row in self.rows.values())

    # ------------------------------------------------------------------ removal
    def _remove(self, row: StoredRow, retire: bool) -> None:
        self.remove_many([row], retire)

    def remove_many(self, removed: list[StoredRow], retire: bool, consumed: bool = False) -> None:
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

    def remove_stale(self, units: list[list[StoredRow]]) -> None:
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
