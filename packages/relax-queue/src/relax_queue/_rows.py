"""How the queue holds rows: one :class:`StoredRow` each, or many rows of one bulk put as a
:class:`Block` (no per-row object), and the per-task and per-lease state over them."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from typing import Any

from relax_queue._config import TaskSpec
from relax_queue._types import Key, Tags

__all__ = ["NO_TAGS", "Block", "Lease", "RetiredKeys", "Segment", "StoredRow", "TaskState", "field_value"]


class _NoTags(dict[str, Any]):
    """The tags of every row put without tags: one shared, read-only empty mapping (pickled as ``{}``).

    Sharing it saves an allocation per row; being read-only, no consumer can change another row's tags.
    """

    def _read_only(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a delivered row's tags are read-only")

    __setitem__ = __delitem__ = update = setdefault = pop = popitem = clear = __ior__ = _read_only

    def __reduce__(self) -> tuple[type[dict[str, Any]], tuple[()]]:
        return dict, ()


NO_TAGS: Mapping[str, int | float | str] = _NoTags()


class Segment:
    """One array column of one ``put_columns`` call, stored whole: its rows hold this object as the
    field's value and their ``offset`` into it, so a put stores no per-row object and a get of rows of
    one put hands back a slice of the array instead of restacking per-row views.

    Attributes:
        data: the column (a numpy array, torch tensor or any sliceable array-like), one row per item.
        nbytes: each row's share of the column's bytes (what capacity and metrics count per row).
    """

    __slots__ = ("data", "nbytes")

    def __init__(self, data: Any, nbytes: int) -> None:
        self.data = data
        self.nbytes = nbytes


def field_value(row: StoredRow, value: Any) -> Any:
    """A stored field value as delivered: a row of its :class:`Segment`, or the value itself."""
    return value.data[row.offset] if type(value) is Segment else value


class StoredRow:
    """A row as held by the queue (internal; batchers see it through ``RowMeta``).

    ``offset`` is the row's index in the :class:`Segment` values of its fields (rows stored by a bulk
    ``put_columns`` of array columns), else 0.
    """

    __slots__ = (
        "deliveries",
        "fields",
        "group_id",
        "group_size",
        "key",
        "nbytes",
        "offset",
        "pending_tasks",
        "tags",
        "v_max",
        "v_min",
    )

    def __init__(
        self,
        key: Key,
        fields: dict[str, Any],
        v_min: int,
        v_max: int,
        group_id: Hashable | None,
        group_size: int | None,
        tags: Mapping[str, int | float | str],
        nbytes: int,
        pending_tasks: int,
        offset: int = 0,
    ) -> None:
        self.key = key
        self.offset = offset
        self.fields = fields
        self.v_min = v_min
        self.v_max = v_max
        self.group_id = group_id
        self.group_size = group_size
        self.tags = tags
        self.nbytes = nbytes
        self.pending_tasks = pending_tasks


class TaskState:
    """Per-task delivery state: rows waiting (FIFO), rows to redeliver first, counters.

    ``returned`` counts, per stored row, the deliveries to this task that came back (nack or
    expiry); a row's next delivery is number ``1 + returned``. Rows never returned have no entry,
    so a first delivery writes nothing per row.
    """

    __slots__ = ("acked", "delivered", "pending", "retry", "returned", "spec", "staleness_hist")

    def __init__(self, spec: TaskSpec) -> None:
        self.spec = spec
        self.pending: OrderedDict[Key, None] = OrderedDict()
        self.retry: OrderedDict[Key, None] = OrderedDict()
        self.returned: dict[Key, int] = {}
        self.delivered = 0
        self.acked = 0
        self.staleness_hist: dict[int, int] = {}


class Lease:
    """Rows of one batch delivered to one task, until ack, nack or expiry."""

    __slots__ = ("batch", "deadline", "lease_id", "on_settle", "ranges", "rows", "task")

    def __init__(
        self,
        lease_id: int,
        task: TaskState,
        rows: list[StoredRow],
        deadline: float,
        ranges: list[tuple[Block, int, int]] | None = None,
    ) -> None:
        self.lease_id = lease_id
        self.task = task
        self.rows = rows
        self.deadline = deadline
        self.on_settle: Callable[[], None] | None = None
        # Rows of blocks, as (block, start, stop), while those blocks are held whole; ``rows`` is
        # filled when they are broken up into stored rows (see ``_blocks.explode``).
        self.ranges = ranges


class Block:
    """The new, ungrouped rows of one bulk ``put_columns``, held whole: per-row state lives in
    lists and cursors, not in per-row objects.

    Every task takes a block's rows in order (``taken``: rows ``[0, taken)`` were leased to it) and
    acks them in order (``acked``); rows ``[0, freed)`` were acked by every task and are gone. Any
    other use of its rows (a field added, a nack, an expiry, a grouped or filtering reader, a
    snapshot, a put of a single row) first breaks every block up into stored rows, exactly the rows
    a row-by-row put would have stored (``_blocks.explode``), so the block is only a faster way to
    hold the same state.

    Attributes:
        keys: the row keys, in put order.
        names: the field names (every row carries exactly these while the block is whole).
        columns: per field, a :class:`Segment` (an array column) or a list with one value per row.
        v_min: every row's oldest version (one int for all, or one per row); ``v_max`` likewise.
        tags: one tags mapping per row, or ``None`` (no tags: every row has ``NO_TAGS``).
        nbytes: each row's payload estimate (one int for all, or one per row).
    """

    __slots__ = ("acked", "columns", "freed", "keys", "names", "nbytes", "tags", "taken", "v_max", "v_min")

    def __init__(
        self,
        keys: list[Key],
        names: tuple[str, ...],
        columns: list[Any],
        v_min: int | list[int],
        v_max: int | list[int],
        tags: list[Tags] | None,
        nbytes: int | list[int],
        tasks: Iterable[str],
    ) -> None:
        self.keys = keys
        self.names = names
        self.columns = columns
        self.v_min = v_min
        self.v_max = v_max
        self.tags = tags
        self.nbytes = nbytes
        self.taken: dict[str, int] = dict.fromkeys(tasks, 0)
        self.acked: dict[str, int] = dict.fromkeys(tasks, 0)
        self.freed = 0


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
