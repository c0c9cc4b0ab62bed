"""Wire forms of the Ray transport's calls: what a client and the queue actor hand Ray to move.

Ray serialises each argument and return value with msgpack, falling back to pickle per object it
cannot pack as-is; with tuples that is one fallback per tuple (a call carrying a list of 1,000 tuple
keys: 1.8 ms here, 0.7 ms with the list pickled first, 0.55 ms for a call carrying nothing). So a
call's keys, metadata and small columns travel as one pickled ``bytes`` (:func:`pack`), and only
what Ray must see itself travels beside it (:func:`split_columns`): arrays of at least
``INLINE_ARRAY_BYTES`` (Ray moves a large argument or reply through the object store without
copying it into a pickle) and columns holding object-store references (:class:`StoreRef`; Ray
tracks the references it serialises, so a row's object cannot be freed while the reference is in
flight). A payload whose pickle names a Ray object (an ``ObjectRef`` or actor handle nested in a
field value), or that plain pickle refuses, goes through Ray's serialiser unchanged.

Ray inlines an argument or return value of less than 100 KiB in the call's own message and puts a larger
one in the object store, which costs more than it saves below a few MiB (a 188 KB argument: 2.3-2.7 ms a
call here, the same bytes as two arguments of 94 KB: 1.2-1.3 ms; returned, 1.4-2.2 ms against 1.1 ms as
two return values). So numpy columns of up to :data:`CHUNKED_MAX_BYTES` travel as pieces of at most
:data:`CHUNK_BYTES` (:func:`chunk_arrays`), each one argument or return value, joined by the receiver
(:func:`unchunk`, one copy of the column: an array of its own).

``ray`` is not imported here.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any, cast

from relax_queue._columnar import is_array
from relax_queue._rows import NO_TAGS

__all__ = [
    "CHUNKED_MAX_BYTES",
    "CHUNK_BYTES",
    "INLINE_ARRAY_BYTES",
    "MAX_REPLY_SLOTS",
    "SMALL_TYPES",
    "Chunks",
    "StoreRef",
    "chunk_arrays",
    "join_columns",
    "load_request",
    "may_hold_refs",
    "pack",
    "pack_column",
    "pack_ints",
    "pack_tags",
    "split_columns",
    "unchunk",
    "unpack",
    "unpack_column",
]

# Smaller arrays are pickled into the call's bytes; larger ones Ray moves beside them (out of band, through
# the object store above 100 KB). One pickle of everything was as fast as the split at 188 KB a call here.
INLINE_ARRAY_BYTES = 16 * 1024
# Pieces stay under Ray's 100 KiB inline limit (max_direct_call_object_size) with their pickle's overhead;
# a call's chunked columns together stay far below its 10 MiB of inlined arguments (task_rpc_inlined_bytes_limit).
CHUNK_BYTES = 64 * 1024
CHUNKED_MAX_BYTES = 2 * 2**20
MAX_REPLY_SLOTS = CHUNKED_MAX_BYTES // CHUNK_BYTES + 1  # a get's return values: the reply and its pieces
SMALL_TYPES = frozenset((int, float, bool, str, type(None)))  # never large enough for the object store
# Markers of a Ray object in a pickle: the module of ObjectRef ("ray", as a short string) and of
# every other Ray class ("ray.actor", "ray._raylet", ...). A user string that contains one only
# sends that payload the slower, always-correct way.
_RAY_MARKERS = (b"\x8c\x03ray\x94", b"ray.")


class StoreRef:
    """A field value living in the Ray object store (the queue holds only this reference).

    ``index`` is ``None`` when the object is the value itself, else the value's position in the
    object, a list of the large values of one ``put_columns`` column (one object, one reference
    for them all: each reference passed through the actor costs Ray bookkeeping on both sides).
    Such an object lives until the last row holding it is freed.
    """

    __slots__ = ("index", "nbytes", "ref")

    def __init__(self, ref: Any, nbytes: int, index: int | None = None) -> None:
        self.ref = ref
        self.nbytes = nbytes  # read by estimate_nbytes, so capacity counts the real payload
        self.index = index

    def pick(self, stored: Any) -> Any:
        """This value, out of ``stored``: the object its reference names, fetched."""
        return stored if self.index is None else stored[self.index]


def pack(payload: tuple[Any, ...] | list[Any]) -> bytes | tuple[Any, ...] | list[Any]:
    """``payload`` as one pickled ``bytes``, or ``payload`` itself when Ray must serialise it.

    The receiver tells the two apart by type (:func:`unpack`): a payload is a tuple or list, never bytes.
    """
    try:
        blob = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # anything plain pickle refuses (lambdas, local classes): Ray's cloudpickle may not
        return payload
    if _RAY_MARKERS[0] in blob or _RAY_MARKERS[1] in blob:
        return payload  # it holds a Ray object: only Ray's serialiser keeps its reference counted
    return blob


def unpack(wire: Any) -> Any:
    """A payload as :func:`pack` sent it."""
    return pickle.loads(wire) if type(wire) is bytes else wire


def load_request(request: bytes) -> tuple[Any, ...]:
    """A get's arguments, pickled by the client in one ``bytes``."""
    return cast("tuple[Any, ...]", pickle.loads(request))


def may_hold_refs(column: list[Any]) -> bool:
    """Whether a column may hold values large enough for the object store (a cheap test by type, in C)."""
    return not set(map(type, column)) <= SMALL_TYPES


def _holds_refs(column: Any) -> bool:
    return type(column) is list and may_hold_refs(column) and StoreRef in set(map(type, column))


def split_columns(columns: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``(inline, passed)``: the columns to pickle into the call's bytes and those Ray must move itself.

    Passed: arrays of at least :data:`INLINE_ARRAY_BYTES` and lists holding :class:`StoreRef` values.
    ``inline`` keeps every column's name (a passed one as ``None``), so the receiver rebuilds the
    columns in their order.
    """
    passed: dict[str, Any] | None = None
    for name, column in columns.items():
        if (is_array(column) and _nbytes(column) >= INLINE_ARRAY_BYTES) or _holds_refs(column):
            if passed is None:
                passed = {}
            passed[name] = column
    if passed is None:
        return columns, None
    return {name: None if name in passed else column for name, column in columns.items()}, passed


def join_columns(inline: dict[str, Any], passed: dict[str, Any] | None) -> dict[str, Any]:
    """The columns :func:`split_columns` split, in their order."""
    if not passed:
        return inline
    return {name: passed.get(name, column) for name, column in inline.items()}


def _nbytes(array: Any) -> int:
    nbytes = getattr(array, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    numel = getattr(array, "numel", None)  # torch tensors: numel() x element_size()
    size = getattr(array, "element_size", None)
    return int(numel() * size()) if callable(numel) and callable(size) else 0


class _Same:
    """Wire form of a per-row metadata column in which every row holds ``value`` (an immutable scalar)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce__(self) -> tuple[type[_Same], tuple[Any]]:
        return _Same, (self.value,)


class _EmptyTags:
    """Wire form of a tags column in which every row's tags are empty."""

    __slots__ = ()

    def __reduce__(self) -> tuple[type[_EmptyTags], tuple[()]]:
        return _EmptyTags, ()


def pack_column(column: list[Any]) -> list[Any] | _Same:
    """``column`` for the wire: its one value when every row holds the same scalar (of one type)."""
    if column and column.count(column[0]) == len(column):
        kinds = set(map(type, column))
        if len(kinds) == 1 and kinds <= SMALL_TYPES:
            return _Same(column[0])
    return column


def pack_ints(column: list[Any]) -> list[Any] | _Same:
    """:func:`pack_column` for a column the queue fills with ints (or ``None``) only: versions,
    staleness, deliveries, group sizes. Their type needs no per-row check (a C-level count is all)."""
    if column and column.count(column[0]) == len(column) and type(column[0]) in SMALL_TYPES:
        return _Same(column[0])
    return column


def pack_tags(tags: list[Any]) -> list[Any] | _EmptyTags:
    """A tags column for the wire: one marker when every row's tags are empty."""
    return _EmptyTags() if tags and tags.count(NO_TAGS) == len(tags) else tags


def unpack_column(column: list[Any] | _Same | _EmptyTags, n: int) -> list[Any]:
    """A column as :func:`pack_column` or :func:`pack_tags` sent it, one entry per row again."""
    kind = type(column)
    if kind is _Same:
        return [cast(_Same, column).value] * n
    if kind is _EmptyTags:
        return [NO_TAGS] * n  # the read-only empty tags every row put without tags shares in-process
    return cast("list[Any]", column)


class Chunks:
    """Wire form of a numpy column sent as ``count`` pieces, starting at ``start`` in the call's pieces."""

    __slots__ = ("count", "start")

    def __init__(self, start: int, count: int) -> None:
        self.start, self.count = start, count

    def __reduce__(self) -> tuple[type[Chunks], tuple[int, int]]:
        return Chunks, (self.start, self.count)


def _is_ndarray(value: Any) -> bool:
    kind = type(value)
    return kind.__name__ == "ndarray" and kind.__module__ == "numpy"


def chunk_arrays(passed: dict[str, Any], first: int = 0) -> tuple[dict[str, Any], list[Any]]:
    """``(passed, pieces)``: ``passed`` with each numpy column that fits :data:`CHUNKED_MAX_BYTES` (all of them
    together) and whose rows are at most :data:`CHUNK_BYTES` replaced by a :class:`Chunks` of ``pieces``
    (row slices of at most :data:`CHUNK_BYTES`: views, no copy); ``first`` numbers the first piece.

    Other columns (larger arrays, torch tensors, lists of references) stay as they are.
    """
    pieces: list[Any] = []
    out: dict[str, Any] | None = None
    budget = CHUNKED_MAX_BYTES
    for name, column in passed.items():
        if not _is_ndarray(column) or column.ndim == 0 or not len(column) or column.nbytes > budget:
            continue
        row_bytes = column.nbytes // len(column)
        if row_bytes > CHUNK_BYTES:
            continue
        budget -= column.nbytes
        step = max(1, CHUNK_BYTES // max(1, row_bytes))
        start = first + len(pieces)
        pieces.extend(column[i : i + step] for i in range(0, len(column), step))
        if out is None:
            out = dict(passed)
        out[name] = Chunks(start, first + len(pieces) - start)
    return (passed if out is None else out), pieces


def unchunk(columns: dict[str, Any], pieces: Sequence[Any]) -> dict[str, Any]:
    """``columns`` with each :class:`Chunks` joined from ``pieces`` (one piece: itself; else one new array)."""
    for name, column in columns.items():
        if type(column) is Chunks:
            parts = pieces[column.start : column.start + column.count]
            if column.count == 1:
                columns[name] = parts[0]
            else:
                import numpy  # the pieces are numpy arrays, so numpy is there

                columns[name] = numpy.concatenate(parts)
    return columns
