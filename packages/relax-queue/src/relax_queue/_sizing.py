"""Byte-size estimates of field values, without importing numpy or torch.

Arrays and tensors are recognised by duck typing (``nbytes`` or ``element_size() * numel()``), so
this module never imports an ML library.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["estimate_nbytes"]

_SCALARS = (int, float, bool, complex, type(None))


def estimate_nbytes(value: Any, _depth: int = 0) -> int:
    """Estimate the payload size of ``value`` in bytes.

    Args:
        value: a field value: ndarray/tensor (``nbytes`` of the data), bytes-like (``len``), str
            (UTF-8 length estimate), list/tuple/dict (sum of items), scalar (8) or other object
            (``sys.getsizeof``).

    Returns:
        The estimate; only used for the byte capacity and metrics, never for correctness.
    """
    if isinstance(value, _SCALARS):
        return 8
    if isinstance(value, bytes | bytearray | str):
        return len(value)
    nbytes = getattr(value, "nbytes", None)  # numpy arrays, torch tensors, memoryviews: one attribute read
    if type(nbytes) is int:
        return nbytes
    element_size = getattr(value, "element_size", None)
    numel = getattr(value, "numel", None)
    if callable(element_size) and callable(numel):  # tensor-likes without nbytes
        return int(element_size()) * int(numel())
    if _depth < 4:
        if isinstance(value, list | tuple | set | frozenset):
            return 8 * len(value) + sum(estimate_nbytes(v, _depth + 1) for v in value)
        if isinstance(value, Mapping):
            return sum(estimate_nbytes(k, _depth + 1) + estimate_nbytes(v, _depth + 1) for k, v in value.items())
    return sys.getsizeof(value)
