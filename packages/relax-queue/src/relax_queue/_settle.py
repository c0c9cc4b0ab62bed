"""The version rules and the one-step settling of an update: ack the batch it consumed and publish the version it
produced, as one change of the queue's state (callers hold the core's lock where a function says so).

A trainer's update ends with two changes that belong together: its batch is consumed, then its new version becomes
visible (in that order, so the batch never counts as stale against the version it produced). Made as one step under
the lock, nobody (a snapshot, an admission, a reader) sees one without the other, and over the Ray transport the two
travel in one actor call instead of two.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

from relax_queue._errors import ArgumentError, VersionError

if TYPE_CHECKING:
    from relax_queue._core import QueueCore
    from relax_queue._replica import ReplicaCoordinator

__all__ = ["ack_and_publish", "check_lease_s", "check_version", "check_version_forward"]


def check_version(version: Any) -> None:
    """A published version must be an int (not a bool).

    Raises:
        VersionError: it is not.
    """
    if not isinstance(version, int) or isinstance(version, bool):
        raise VersionError(f"version must be an int, got {version!r}")


def check_version_forward(core: QueueCore, version: int, after: str = "") -> None:
    """A published version must not go below the current one (caller holds the lock).

    Args:
        after: appended to the error (what the refusal left undone).

    Raises:
        VersionError: ``version`` is below the current version.
    """
    if version < core.version:
        raise VersionError(f"version must not go backwards: current {core.version}, got {version}{after}")


def check_lease_s(task: str, lease_s: Any) -> None:
    """``lease_s`` of a get: ``None`` (the queue's ``lease_timeout_s``) or a finite number of seconds > 0.

    Raises:
        ArgumentError: anything else (nothing is leased).
    """
    if lease_s is None:
        return
    if type(lease_s) not in (int, float) or not math.isfinite(lease_s) or lease_s <= 0:
        raise ArgumentError(
            f"get for task {task!r}: lease_s must be None (the queue's lease_timeout_s) or a finite number of "
            f"seconds > 0, got {lease_s!r}"
        )


def ack_and_publish(
    core: QueueCore, replicas: ReplicaCoordinator, lease_id: int, version: int, rank: int | None
) -> None:
    """Ack lease ``lease_id`` and publish ``version`` in one step (caller checked ``version``'s type, holds the
    lock and checked the queue is open).

    A refused call changes nothing: a version below the current one acks nothing, an unknown, settled or expired
    lease publishes nothing. With ``rank`` (a replica set) the version is published by the call whose ack settles
    the lease (the last rank's), so it never becomes visible before the batch is consumed; an earlier rank's call
    only records its ack.

    Raises:
        VersionError: ``version`` is below the current version.
        LeaseError: the lease is unknown, already settled, or expired.
    """
    check_version_forward(core, version, f" (lease {lease_id} was not acked)")
    heap = core.lease_heap
    if heap and heap[0][0] <= time.monotonic():
        core.expire(time.monotonic())  # a lease past its deadline can no longer be acked
    if rank is not None and not replicas.ack(lease_id, rank):
        return
    core.ack(lease_id)
    core.version = version
    core.notify()
