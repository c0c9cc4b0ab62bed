"""Opaque payloads: field values that cross a process boundary as bytes pickled by their producer.

A queue actor unpickles every argument it receives, and unpickling an object imports the module of its class:
a row holding a model's prompt object makes the actor import that model's whole stack (hundreds of MB per
process) although the queue never looks inside the value. So the Ray transport's client pickles each field
value whose types live outside the modules every queue process has (:data:`PLAIN_MODULES`) into a
:class:`Payload` before sending it, and the consumer's client unpickles it after receiving it; the actor holds
bytes. Snapshot files keep such values the same way, so a file written in one process (or transport) loads in
any other without importing the values' modules where the queue holds them.

The queue itself reads only the row's key, versions, group and tags, never field values, so nothing it does
changes; its byte count of a payload is the payload's length, which is exact.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["PLAIN_MODULES", "Payload", "PayloadPacker", "is_plain", "open_payloads"]

PLAIN_MODULES = frozenset(("builtins", "numpy", "ray", "relax_queue"))
"""Top-level modules whose objects travel as they are: every queue process has them loaded already (Python's
builtins; numpy and ray, which a Ray worker imports; this package). An object of any other module's class
travels as a :class:`Payload`."""

_SCALARS = frozenset((int, float, bool, complex, str, bytes, type(None)))
_MAX_DEPTH = 8  # deeper containers are packed whole rather than walked


class Payload:
    """A field value pickled by its producer: the queue holds and moves ``data`` and never unpickles it.

    Attributes:
        data: The value's pickle (protocol 5).
        nbytes: ``len(data)``: what the queue's byte count (``estimate_nbytes``) reads.
    """

    __slots__ = ("data", "nbytes")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.nbytes = len(data)

    @classmethod
    def of(cls, value: Any) -> Payload:
        """``value`` pickled."""
        return cls(pickle.dumps(value, protocol=5))

    def open(self) -> Any:
        """The value (unpickled: imports its classes' modules, in the caller's process)."""
        return pickle.loads(self.data)

    def __reduce__(self) -> tuple[type[Payload], tuple[bytes]]:
        return Payload, (self.data,)

    def __repr__(self) -> str:
        return f"Payload({self.nbytes} bytes)"


def is_plain(value: Any, _depth: int = 0) -> bool:
    """Whether ``value`` unpickles without importing anything a queue process lacks: scalars, strings, bytes,
    lists / tuples / dicts of plain values, and objects of :data:`PLAIN_MODULES` (numpy arrays of objects
    excepted: their items may be anything)."""
    kind = type(value)
    if kind in _SCALARS:
        return True
    if kind is list or kind is tuple:
        if set(map(type, value)) <= _SCALARS:  # the usual case (token ids, log-probs), decided in C
            return True
        return _depth < _MAX_DEPTH and all(is_plain(v, _depth + 1) for v in value)
    if kind is dict:
        depth = _depth + 1
        return _depth < _MAX_DEPTH and all(is_plain(k, depth) and is_plain(v, depth) for k, v in value.items())
    if kind is set or kind is frozenset:
        return _depth < _MAX_DEPTH and all(is_plain(v, _depth + 1) for v in value)
    if kind.__module__.partition(".")[0] not in PLAIN_MODULES:
        return False
    dtype = getattr(value, "dtype", None)
    return not bool(getattr(dtype, "hasobject", False))


class PayloadPacker:
    """Packs the non-plain values of one message, each distinct object once.

    A value shared by several rows (a prompt held by each sample row of its group) is pickled once and sent as
    one :class:`Payload` object that every row holds, as pickling the message would have shared the value
    itself.
    """

    def __init__(self) -> None:
        self._packed: dict[int, tuple[Any, Payload]] = {}  # id(value) -> (value kept alive, its payload)

    def pack(self, value: Any) -> Any:
        """``value`` as it travels: itself when plain, else its :class:`Payload`."""
        if is_plain(value) or type(value) is Payload:
            return value
        hit = self._packed.get(id(value))
        if hit is None:
            hit = self._packed[id(value)] = (value, Payload.of(value))
        return hit[1]

    def pack_fields(self, fields: Mapping[str, Any]) -> Mapping[str, Any]:
        """``fields`` with its non-plain values packed (the same mapping when all are plain)."""
        out: dict[str, Any] | None = None
        for name, value in fields.items():
            packed = self.pack(value)
            if packed is not value:
                if out is None:
                    out = dict(fields)
                out[name] = packed
        return fields if out is None else out

    def pack_column(self, column: list[Any]) -> list[Any]:
        """A list column with its non-plain values packed (the same list when all are plain)."""
        if set(map(type, column)) <= _SCALARS:
            return column
        packed = [self.pack(v) for v in column]
        return column if all(p is v for p, v in zip(packed, column, strict=True)) else packed


def open_payloads(containers: Iterable[Any], items: Callable[[Any], Iterable[tuple[Any, Any]]]) -> None:
    """Replace every :class:`Payload` in ``containers`` by its value, in place; one payload object shared by
    several slots is unpickled once (the slots share the value again).

    Args:
        containers: dicts (a row's fields) or lists (a column), written through ``container[slot] = value``.
        items: ``(slot, value)`` pairs of one container (``dict.items`` or ``enumerate``).
    """
    opened: dict[int, Any] = {}
    for container in containers:
        for slot, value in list(items(container)):
            if type(value) is Payload:
                key = id(value)
                if key not in opened:
                    opened[key] = value.open()
                container[slot] = opened[key]
