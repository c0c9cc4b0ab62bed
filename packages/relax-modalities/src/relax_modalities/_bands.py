"""Band-parallel work for one image: a pool of helper threads and the cut of an axis into bands.

The helpers come from one pool that this module owns: created on first use (again after a fork,
whose child has none of the parent's threads), grown by `concurrent.futures` only as far as
concurrent work needs, its idle threads joined by `concurrent.futures` at interpreter exit. The
calling thread always runs one band, so ``n`` bands use ``n - 1`` helpers.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

MAX_THREADS_PER_IMAGE = 16
"""Upper bound of `ImageSettings.threads_per_image` (the pool has one thread fewer)."""

_T = TypeVar("_T")
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (pid of the owning process, pool)
_pool_lock = threading.Lock()

Band = tuple[int, int]
"""``[start, stop)`` along one axis."""


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one, else ``os.cpu_count()``)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def bands(size: int, n: int, align: int = 1) -> list[Band]:
    """At most ``n`` near-equal bands covering ``range(size)``, cut at multiples of ``align``."""
    units = -(-size // align)  # ceil
    n = max(1, min(n, units))
    cuts = [min(size, align * (units * i // n)) for i in range(n + 1)]
    return list(itertools.pairwise(cuts))


def map_bands(fn: Callable[[Band], _T], spans: Sequence[Band]) -> list[_T]:
    """``[fn(b) for b in spans]``: the first band on the calling thread, the others on the pool.

    Every band has finished when this returns or raises (none writes into shared output later).
    Bands are handed out statically: measured, finer bands taken from a shared queue balanced
    unequal threads no better than their extra calls cost.
    """
    futures: list[Future[_T]] = [_executor().submit(fn, b) for b in spans[1:]]
    try:
        first = fn(spans[0])
    finally:
        for f in futures:
            f.exception()  # waits; an error is raised by result() below
    return [first, *(f.result() for f in futures)]


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(MAX_THREADS_PER_IMAGE - 1, thread_name_prefix="relax-band"))
        return _pool[1]
