"""The peak of torch's CPU allocations while a function runs, counted from the profiler's records (the chunked
scoring test and the vocabulary sweep, :mod:`relax_services.bench.vocab_memory`)."""

from __future__ import annotations

from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile

__all__ = ["peak_bytes"]


def peak_bytes(fn: Callable[[], object]) -> int:
    """The most bytes the CPU allocator held at once while ``fn()`` ran, beyond what it held before: the running
    sum of the profiler's allocation and free records (every allocation torch makes, in order).

    Exact, not a machine's luck: the same count on any machine for the same operations."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in records:
        live += nbytes
        peak = max(peak, live)
    return peak
