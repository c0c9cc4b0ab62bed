"""Counters and latency windows behind ``TransferQueue.metrics()``."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from relax_queue._core import QueueCore

__all__ = ["Counters", "latency_summary", "queue_metrics"]


@dataclass
class Counters:
    """Queue-wide event counts (per-task counts live with each task)."""

    puts: int = 0
    duplicate_puts: int = 0
    conflicting_puts: int = 0
    fields_added: int = 0
    add_fields_unknown_key: int = 0
    put_waits: int = 0
    drops: int = 0
    requeues: int = 0
    flagged: int = 0
    redeliveries: int = 0
    expired_leases: int = 0
    nacks: int = 0
    freed: int = 0
    admission_granted: int = 0
    admission_waits: int = 0
    admission_wait_s: float = 0.0
    admission_released: int = 0
    admission_failed: int = 0
    admission_refunded: int = 0
    admission_unmatched: int = 0
    admission_duplicates: int = 0
    put_latency_s: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))
    get_latency_s: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))

    @classmethod
    def with_window(cls, latency_window: int) -> Counters:
        """Zeroed counters whose latency windows keep the last ``latency_window`` samples."""
        return cls(put_latency_s=deque(maxlen=latency_window), get_latency_s=deque(maxlen=latency_window))

    def scalars(self) -> dict[str, Any]:
        """The integer/float counters as a plain dict."""
        return {k: v for k, v in vars(self).items() if not isinstance(v, deque)}


def latency_summary(samples: deque[float]) -> dict[str, float]:
    """p50/p99/max in milliseconds over the window, plus the sample count."""
    if not samples:
        return {"count": 0, "p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}
    ordered = sorted(samples)
    n = len(ordered)
    return {
        "count": n,
        "p50_ms": ordered[(n - 1) // 2] * 1e3,
        "p99_ms": ordered[min(n - 1, int(0.99 * n))] * 1e3,
        "max_ms": ordered[-1] * 1e3,
    }


def queue_metrics(core: QueueCore, now: float) -> dict[str, Any]:
    """``TransferQueue.metrics()`` of ``core`` at monotonic time ``now`` (caller holds the lock)."""
    core.unblock()  # per-task backlogs and leases are counted over stored rows
    core.expire(now)
    leased: dict[str, int] = {name: 0 for name in core.tasks}
    for lease in core.leases.values():
        leased[lease.task.spec.name] += len(core.live_rows(lease))
    counters = core.counters.scalars()
    return {
        "depth_rows": len(core.rows),
        "depth_bytes": core.nbytes if core.config.capacity.max_bytes is not None else core.measure_bytes(),
        "max_rows": core.config.capacity.max_rows,
        "max_bytes": core.config.capacity.max_bytes,
        "version": core.version,
        "tasks": {
            name: {
                "backlog": len(ts.pending) + len(ts.retry),
                "leased": leased[name],
                "delivered": ts.delivered,
                "acked": ts.acked,
                "staleness_histogram": dict(sorted(ts.staleness_hist.items())),
            }
            for name, ts in core.tasks.items()
        },
        "admission": {
            "accepted": core.accepted,
            "running": core.running,
            "capacity": core.admission_capacity(),
            "granted": counters.pop("admission_granted"),
            "waits": counters.pop("admission_waits"),
            "wait_s": counters.pop("admission_wait_s"),
            "released": counters.pop("admission_released"),
            "failed": counters.pop("admission_failed"),
            "refunded": counters.pop("admission_refunded"),
            "unmatched": counters.pop("admission_unmatched"),
            "duplicates": counters.pop("admission_duplicates"),
        },
        "requeued_pending": len(core.requeued),
        **counters,
        "put_latency": latency_summary(core.counters.put_latency_s),
        "get_latency": latency_summary(core.counters.get_latency_s),
    }
