"""Settling leases over a :class:`QueueCore`: ack, nack, renew and expiry (callers hold its lock).

A lease holds the stored rows it delivered. Rows dropped, requeued or put again under the same key
since the lease was taken are no longer the stored row of that key, so the lease does not count for
them (not acked, not redelivered).
"""

from __future__ import annotations

import heapq
from operator import attrgetter, is_
from typing import TYPE_CHECKING

from relax_queue._blocks import ack_ranges, explode
from relax_queue._errors import LeaseError
from relax_queue._fields import BULK
from relax_queue._rows import Lease, StoredRow

if TYPE_CHECKING:
    from relax_queue._core import QueueCore

__all__ = ["ack", "expire", "live_rows", "nack", "next_deadline", "push_deadline", "renew"]

_row_key = attrgetter("key")


def _pop_lease(core: QueueCore, lease_id: int, action: str) -> Lease:
    held = core.leases.get(lease_id)
    if held is not None and held.ranges is not None:
        explode(core)  # fills the lease's rows
    lease = core.leases.pop(lease_id, None)
    if lease is None:
        raise LeaseError(f"cannot {action} lease {lease_id}: it is unknown, already settled, or expired")
    if lease.on_settle is not None:
        lease.on_settle()
    return lease


def ack(core: QueueCore, lease_id: int) -> int:
    """Consume the lease's rows for its task; returns how many rows were freed entirely."""
    held = core.leases.get(lease_id)
    if held is not None and held.ranges is not None:
        freed = ack_ranges(core, held)  # block rows acked in order: no per-row work
        if freed is not None:
            return freed
    lease = _pop_lease(core, lease_id, "ack")
    rows = core.rows
    returned = lease.task.returned
    leased = lease.rows
    done: list[StoredRow] = []
    append = done.append
    acked = len(leased)
    if len(leased) >= BULK and not returned and all(map(is_, map(rows.get, map(_row_key, leased)), leased)):
        # The usual case (none dropped or returned meanwhile), checked in C above.
        if len(core.tasks) == 1:
            done = leased  # this task was the only one each row waited for
        else:
            for row in leased:
                left = row.pending_tasks - 1
                row.pending_tasks = left
                if not left:
                    append(row)
    else:
        for row in leased:
            if rows.get(row.key) is not row:  # dropped or requeued meanwhile: not consumed by this ack
                acked -= 1
                continue
            if returned:
                returned.pop(row.key, None)
            row.pending_tasks -= 1
            if row.pending_tasks == 0:
                append(row)
    if done:
        core.remove_many(done, retire=True, consumed=True)
    lease.task.acked += acked
    core.counters.freed += len(done)
    return len(done)


def nack(core: QueueCore, lease_id: int) -> None:
    """Return the lease's rows to its task for redelivery (first in line)."""
    lease = _pop_lease(core, lease_id, "nack")
    core.counters.nacks += 1
    _redeliver(core, lease)


def renew(core: QueueCore, lease_id: int, now: float, timeout_s: float | None) -> float:
    """Extend a lease to ``now + timeout_s`` (default the lease timeout); returns the new deadline."""
    lease = core.leases.get(lease_id)
    if lease is None:
        raise LeaseError(f"cannot renew lease {lease_id}: it is unknown, already settled, or expired")
    lease.deadline = now + (timeout_s if timeout_s is not None else core.config.lease_timeout_s)
    push_deadline(core, lease.deadline, lease_id)
    return lease.deadline


def push_deadline(core: QueueCore, deadline: float, lease_id: int) -> None:
    """Track a lease deadline. Settled and renewed leases leave stale entries behind until their
    deadline passes; rebuild the heap from the live leases when those outnumber them, so that it
    stays O(live leases) at any ack rate."""
    heap = core.lease_heap
    if len(heap) > 2 * len(core.leases) + 64:
        heap[:] = [(lease.deadline, lid) for lid, lease in core.leases.items() if lid != lease_id]
        heapq.heapify(heap)
    heapq.heappush(heap, (deadline, lease_id))


def _redeliver(core: QueueCore, lease: Lease) -> None:
    rows = core.rows
    retry = lease.task.retry
    returned = lease.task.returned
    for row in lease.rows:
        if rows.get(row.key) is row:
            retry[row.key] = None
            returned[row.key] = returned.get(row.key, 0) + 1
            core.counters.redeliveries += 1


def expire(core: QueueCore, now: float) -> bool:
    """Redeliver the rows of every lease past its deadline; ``True`` if any expired."""
    heap = core.lease_heap
    expired = False
    while heap and heap[0][0] <= now:
        deadline, lease_id = heapq.heappop(heap)
        lease = core.leases.get(lease_id)
        if lease is None or lease.deadline != deadline:  # settled, or renewed (a newer entry exists)
            continue
        _pop_lease(core, lease_id, "expire")
        core.counters.expired_leases += 1
        _redeliver(core, lease)
        expired = True
    if expired:
        core.notify()
    return expired


def live_rows(core: QueueCore, lease: Lease) -> list[StoredRow]:
    """The rows of ``lease`` still stored as leased (not dropped, requeued or re-put since)."""
    core.unblock()
    rows = core.rows
    return [row for row in lease.rows if rows.get(row.key) is row]


def next_deadline(core: QueueCore) -> float | None:
    """The earliest lease deadline (blocked waiters wake then to expire it)."""
    return core.lease_heap[0][0] if core.lease_heap else None
