"""Handing the C heap's free memory back to the system after a large piece of work (glibc only; a no-op elsewhere).

torch's CPU tensors come from the C allocator. glibc serves an allocation below its mmap threshold from a heap,
and that threshold rises to the largest block freed so far (up to 32 MB), so after one training update most of a
model's gradients and activations live in heaps. Memory freed there goes back to the system only when it ends the
heap; the rest stays resident, counted in the process's RSS, until it is reused. Measured on SmolLM2-135M (one
torch engine, three updates of 32 samples): resident 3.69 GB between updates, of which the live tensors (weights,
AdamW moments) are 2.08 GB; after :func:`release_free_memory` 2.34 GB, for a few milliseconds per call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["limit_arenas", "release_free_memory"]


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def release_free_memory() -> bool:
    """Returns the free pages of every glibc heap of this process to the system (``malloc_trim(0)``).

    Returns:
        True if glibc released memory, False if there was none to release or the C library is not glibc.
    """
    libc = _libc()
    return bool(libc is not None and libc.malloc_trim(0))


M_ARENA_MAX = -8
"""glibc's ``mallopt`` parameter for the most heaps (arenas) threads may spread over."""


def limit_arenas(count: int) -> bool:
    """Caps the glibc heaps of this process at ``count`` (``mallopt(M_ARENA_MAX)``), as ``MALLOC_ARENA_MAX`` does
    for a process started with it: threads that allocate share them instead of each holding free memory of its own.
    Takes effect for heaps created afterwards; call it before starting threads.

    Returns:
        True if set, False if the C library is not glibc.
    """
    libc = _libc()
    return bool(libc is not None and libc.mallopt(M_ARENA_MAX, count))
