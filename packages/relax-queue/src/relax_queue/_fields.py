"""Validation and sizing of the values a put hands the queue: versions, field mappings, payload bytes."""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any

from relax_queue._errors import FieldTypeError
from relax_queue._sizing import estimate_nbytes
from relax_queue._types import Key

__all__ = ["BULK", "as_version", "check_fields", "fields_nbytes", "has_fields", "parse_versions"]

BULK = 16  # from this many rows on, a C-level pass (map/all) beats a Python loop over them


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


def has_fields(fields: tuple[str, ...]) -> Callable[[dict[str, Any]], bool]:
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
