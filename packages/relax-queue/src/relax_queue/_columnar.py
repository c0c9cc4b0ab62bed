"""The columnar bulk path: rows put as columns (one key list, one value list per field) and
batches leased as columns, without a per-row input or output object.

Validation, duplicate and capacity checks, counters and per-task bookkeeping run once per call.
A put whose rows are all new, ungrouped and fit the capacity is stored in bulk; any other put
(known or retired keys, groups, a queue near full) goes row by row through the same insert as
``put_many``, so both paths keep the same guarantees.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from itertools import repeat
from operator import add, attrgetter, is_, itemgetter, le
from typing import Any, cast

from relax_queue._batchers import Batcher
from relax_queue._blocks import SLOW, Range, choose_ranges, columns_batch, staleness_of, store
from relax_queue._core import FULL, QueueCore, Segment, StoredRow, TaskState, as_version, field_value
from relax_queue._errors import FieldTypeError
from relax_queue._sizing import estimate_nbytes
from relax_queue._types import ColumnBatch, Key, Tags

__all__ = ["ColumnInput", "put_columns", "try_get_columns"]

_SCALAR_TYPES = frozenset((int, float))
_key = attrgetter("key")
_fields = attrgetter("fields")
_v_min = attrgetter("v_min")
_v_max = attrgetter("v_max")
_group_id = attrgetter("group_id")
_group_size = attrgetter("group_size")
_tags = attrgetter("tags")
_offset = attrgetter("offset")


def is_array(values: Any) -> bool:
    """Whether a column is an array (numpy, torch, any array-like with a ``shape`` and slicing), by duck typing."""
    if type(values) is list or type(values) is tuple:
        return False
    shape = getattr(values, "shape", None)
    return isinstance(shape, tuple) and len(shape) >= 1 and hasattr(values, "__getitem__")


def _as_column(what: str, values: Any, n: int) -> Any:
    """A field column: an array stays whole (stored as one segment), anything else becomes a list."""
    if is_array(values):
        if values.shape[0] != n:
            raise FieldTypeError(f"put_columns: {what} has {values.shape[0]} values for {n} keys")
        return values
    return _as_list(what, values, n)


def _as_list(what: str, values: Any, n: int | None) -> list[Any]:
    """``values`` (any sized iterable but a string or mapping) as a list of ``n`` items."""
    if isinstance(values, str | bytes | Mapping) or not isinstance(values, Iterable):
        raise FieldTypeError(f"put_columns: {what} must be a sequence, got {type(values).__name__}")
    out = values if type(values) is list else list(values)
    if n is not None and len(out) != n:
        raise FieldTypeError(f"put_columns: {what} has {len(out)} values for {n} keys")
    return out


def _versions(what: str, values: Any, keys: list[Key]) -> int | list[int]:
    """A version column: one int >= 0 for every row, or one per row (numpy integers taken as ints)."""
    if type(values) is int and values >= 0:
        return values
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        one = as_version(values)
        if one is None:
            raise FieldTypeError(f"put_columns: {what} must be an int >= 0 or one per key, got {values!r}")
        return one
    tolist = getattr(values, "tolist", None)  # a numpy array of versions: its items as Python ints
    out = _as_list(what, tolist() if callable(tolist) else values, len(keys))
    if out and not (set(map(type, out)) <= {int} and min(out) >= 0):
        out = list(map(as_version, out))
        if None in out:
            i = out.index(None)
            raise FieldTypeError(
                f"put_columns: {what}[{i}] (key {keys[i]!r}) must be an int >= 0, got {list(values)[i]!r}"
            )
    return out


class ColumnInput:
    """A columnar put, validated once: ``n`` keys and, per field, ``n`` values.

    Attributes:
        keys: the row keys.
        names: the field names.
        columns: per field, in ``names`` order, a list of values or an array (one row per item).
        v_min: every row's oldest version (an int shared by all rows, or one per row).
        v_max: every row's newest version, likewise.
        group_ids: one group id (or ``None``) per row; ``None`` when no row has a group.
        group_sizes: the group size of every row (an int or ``None`` shared by all, or one per row).
        tags: one tags dict per row, or ``None`` when no tags were given.
    """

    __slots__ = ("columns", "group_ids", "group_sizes", "keys", "names", "tags", "v_max", "v_min", "versions_given")

    def __init__(
        self,
        keys: Sequence[Key],
        columns: Mapping[str, Sequence[Any]],
        v_min: int | Sequence[int] | None = None,
        v_max: int | Sequence[int] | None = None,
        group_ids: Sequence[Hashable | None] | None = None,
        group_sizes: int | Sequence[int | None] | None = None,
        tags: Mapping[str, Sequence[int | float | str]] | None = None,
    ) -> None:
        """Validate a columnar put; every error names the argument (and index) that is wrong.

        Raises:
            FieldTypeError: a column's length differs from the keys', a field name is not a str,
                a version is not an int >= 0 or ``v_min > v_max``, or an argument has the wrong type.
        """
        self.keys: list[Key] = _as_list("keys", keys, None)
        n = len(self.keys)
        if not isinstance(columns, Mapping):
            raise FieldTypeError(f"put_columns: columns must map field name to values, got {type(columns).__name__}")
        for name in columns:
            if type(name) is not str:
                raise FieldTypeError(f"put_columns: field names must be str, got {name!r}")
        self.names: tuple[str, ...] = tuple(columns)
        # Array columns stay arrays: one buffer per column, stored and shipped whole, sliced on get.
        self.columns: list[Any] = [_as_column(f"column {name!r}", columns[name], n) for name in self.names]
        # Versions left out are not checked against stored rows of the same keys (new rows get 0).
        self.versions_given = v_min is not None or v_max is not None
        self.v_min: int | list[int] = 0 if v_min is None else _versions("v_min", v_min, self.keys)
        self.v_max: int | list[int] = self.v_min if v_max is None else _versions("v_max", v_max, self.keys)
        self._check_order()
        self.group_ids: list[Hashable | None] | None = None
        if group_ids is not None:
            ids = _as_list("group_ids", group_ids, n)
            if ids.count(None) != n:
                self.group_ids = ids
        self.group_sizes: int | list[int | None] | None = None
        if isinstance(group_sizes, int):
            self.group_sizes = group_sizes
        elif group_sizes is not None:
            sizes = _as_list("group_sizes", group_sizes, n)
            if sizes.count(None) != n:
                self.group_sizes = sizes
        self.tags: list[Tags] | None = None
        if tags:
            if not isinstance(tags, Mapping):
                raise FieldTypeError(f"put_columns: tags must map tag name to values, got {type(tags).__name__}")
            tag_names = tuple(tags)
            tag_columns = [_as_list(f"tags column {name!r}", tags[name], n) for name in tag_names]
            self.tags = [dict(zip(tag_names, values, strict=True)) for values in zip(*tag_columns, strict=True)]

    def _check_order(self) -> None:
        lo, hi = self.v_min, self.v_max
        if isinstance(lo, int) and isinstance(hi, int):
            ok = lo <= hi
        else:
            n = len(self.keys)
            ok = all(
                map(le, repeat(lo, n) if isinstance(lo, int) else lo, repeat(hi, n) if isinstance(hi, int) else hi)
            )
        if not ok:
            i = next(i for i in range(len(self.keys)) if self._version(self.v_min, i) > self._version(self.v_max, i))
            raise FieldTypeError(
                f"put_columns: row {i} (key {self.keys[i]!r}) has v_min={self._version(self.v_min, i)} "
                f"> v_max={self._version(self.v_max, i)}"
            )

    @staticmethod
    def _version(column: int | list[int], i: int) -> int:
        return column if isinstance(column, int) else column[i]

    def __len__(self) -> int:
        return len(self.keys)

    def row(
        self, i: int
    ) -> tuple[Key, dict[str, Any], tuple[int, int] | None, Hashable | None, int | None, Tags | None]:
        """Row ``i`` as the per-row insert takes it."""
        sizes = self.group_sizes
        return (
            self.keys[i],
            {name: column[i] for name, column in zip(self.names, self.columns, strict=True)},
            (self._version(self.v_min, i), self._version(self.v_max, i)) if self.versions_given else None,
            None if self.group_ids is None else self.group_ids[i],
            sizes if sizes is None or isinstance(sizes, int) else sizes[i],
            None if self.tags is None else self.tags[i],
        )


def put_columns(core: QueueCore, cols: ColumnInput, start: int, admitted: bool, inserted: list[Key]) -> int:
    """Store rows ``start:`` of ``cols`` (caller holds the lock), like ``QueueCore.put_rows``.

    Returns:
        The index of the first row that must wait for capacity (``len(cols)``: all handled).
        Rows before a row that raises stay stored (and waiting readers are woken for them); the keys
        of newly stored rows are appended to ``inserted``.
    """
    if start < len(cols) and _put_new_rows(core, cols, start):
        core._commit(cols.keys[start:], admitted, len(cols) - start, queue=False)
        inserted.extend(cols.keys[start:])
        return len(cols)
    new: list[Key] = []
    handled = start
    try:
        for i in range(start, len(cols)):
            row = cols.row(i)
            outcome = core._insert(*row)
            if outcome is FULL:
                break
            if outcome:
                new.append(row[0])
            handled = i + 1
    except BaseException:
        core.commit_partial(new, admitted, handled - start, inserted)
        raise
    core._commit(new, admitted, handled - start)
    inserted.extend(new)
    return handled


def _put_new_rows(core: QueueCore, cols: ColumnInput, start: int) -> bool:
    """Store rows ``start:`` in bulk, as one block, when they are new, ungrouped and all fit; ``False``
    otherwise (nothing stored: the per-row path handles known keys, groups and a full queue)."""
    if cols.group_ids is not None or cols.group_sizes is not None:
        return False
    keys = cols.keys[start:] if start else cols.keys
    n = len(keys)
    cap = core.config.capacity
    if cap.max_rows is not None and core.row_count() + n > cap.max_rows:
        return False
    # Each key is hashed once (tuples do not cache their hash): set-to-set tests reuse the stored hashes.
    unique = set(keys)
    if (
        len(unique) != n
        or (core.rows and not core.rows.keys().isdisjoint(unique))
        or (core.block_keys and not core.block_keys.keys().isdisjoint(unique))
        or not core.retired.isdisjoint(unique)
    ):
        return False
    columns = [column[start:] for column in cols.columns] if start else cols.columns
    # An array column is held as one segment (no per-row object); a list column as the list.
    segments = [Segment(c, _share(c, n)) if is_array(c) else None for c in columns]
    constant, per_row, total = 0, None, 0
    if cap.max_bytes is not None:  # sizing only serves the byte bound; unbounded queues skip it
        constant, per_row = _row_nbytes(columns, segments)
        total = constant * n + (sum(per_row) if per_row is not None else 0)
        largest = constant + (max(per_row) if per_row else 0)
        if core.nbytes + total > cap.max_bytes or largest > cap.max_bytes:
            return False
    if any(segments):
        core.segments += 1
    store(
        core,
        keys if type(keys) is list else list(keys),
        unique,
        cols.names,
        [column if seg is None else seg for column, seg in zip(columns, segments, strict=True)],
        cols.v_min if isinstance(cols.v_min, int) else cols.v_min[start:],
        cols.v_max if isinstance(cols.v_max, int) else cols.v_max[start:],
        None if cols.tags is None else cols.tags[start:],
        constant if per_row is None else list(map(add, repeat(constant), per_row)),
    )
    core.nbytes += total
    return True


def _share(column: Any, n: int) -> int:
    """Each row's share of an array column's bytes (one ``nbytes`` read, no walk of the rows)."""
    nbytes = getattr(column, "nbytes", None)
    if type(nbytes) is not int:
        nbytes = estimate_nbytes(column)
    return nbytes // n if n else 0


def _row_nbytes(columns: list[Any], segments: list[Segment | None]) -> tuple[int, list[int] | None]:
    """Per-row payload estimate: a constant (scalar columns, 8 bytes a value; array columns, each row's
    share) plus, when some column holds other values, one figure per row."""
    constant = 0
    per_row: list[int] | None = None
    for column, seg in zip(columns, segments, strict=True):
        if seg is not None:
            constant += seg.nbytes
        elif set(map(type, column)) <= _SCALAR_TYPES:
            constant += 8
        else:
            sizes = list(map(estimate_nbytes, column))
            per_row = sizes if per_row is None else list(map(add, per_row, sizes))
    return constant, per_row


def try_get_columns(
    core: QueueCore, task: str, fields: tuple[str, ...] | None, n: int | None, batcher: Batcher, now: float
) -> ColumnBatch | None:
    """``QueueCore.try_get`` delivering columns (caller holds the lock)."""
    ts = core.tasks.get(task) or core.task(task)
    if core.blocks:
        ranges = choose_ranges(core, ts, fields, n, batcher, now)
        if ranges is not SLOW:
            return None if ranges is None else columns_batch(core, ts, fields, cast("list[Range]", ranges), now)
    rows = core.choose(ts, fields, n, batcher, now)
    return None if rows is None else lease_columns(core, ts, fields, rows, now)


def lease_columns(
    core: QueueCore, ts: TaskState, fields: tuple[str, ...] | None, rows: list[StoredRow], now: float
) -> ColumnBatch:
    """Lease ``rows`` to ``ts`` and deliver them as columns."""
    names = fields if fields is not None else _shared_fields(rows)  # raises before anything is leased
    lease_id, timeout = core.take(ts, rows, now)
    count = len(rows)
    keys = list(map(_key, rows))
    v_min = list(map(_v_min, rows))
    staleness, stale = staleness_of(core, ts, v_min)
    returned = ts.returned
    deliveries = list(map(add, repeat(1), map(returned.get, keys, repeat(0)))) if returned else [1] * count
    row_fields = list(map(_fields, rows))
    columns = {name: list(map(itemgetter(name), row_fields)) for name in names}
    if core.segments:
        for name, values in columns.items():
            if type(values[0] if values else None) is Segment or Segment in set(map(type, values)):
                columns[name] = _segment_column(rows, values)
    ts.delivered += count
    return ColumnBatch(
        ts.spec.name,
        lease_id,
        keys,
        columns,
        v_min,
        list(map(_v_max, rows)),
        list(map(_group_id, rows)) if core.groups else [None] * count,
        list(map(_group_size, rows)) if core.groups else [None] * count,
        list(map(_tags, rows)),
        staleness,
        stale,
        deliveries,
        timeout,
        core.version,
    )


def _segment_column(rows: list[StoredRow], values: list[Any]) -> Any:
    """A delivered column whose rows hold segments: a slice of the array when the rows are consecutive
    rows of one segment (the usual case: they came from one put), else one value per row."""
    first = values[0]
    offsets = list(map(_offset, rows))
    start = offsets[0]
    if (
        type(first) is Segment
        and all(map(is_, values, repeat(first)))  # by identity: == against an array value is elementwise
        and offsets == list(range(start, start + len(rows)))
    ):
        return first.data[start : start + len(rows)]
    return [field_value(row, value) for row, value in zip(rows, values, strict=True)]


def _shared_fields(rows: list[StoredRow]) -> tuple[str, ...]:
    """The fields every row carries, when all carry the same ones (``fields=None`` readers)."""
    if not rows:
        return ()
    first = rows[0].fields.keys()
    for row in rows:
        if row.fields.keys() != first:
            raise FieldTypeError(
                f"get_columns with fields=None needs rows carrying the same fields; row {rows[0].key!r} has "
                f"{sorted(first)}, row {row.key!r} has {sorted(row.fields)}: name the fields the reader needs"
            )
    return tuple(first)
