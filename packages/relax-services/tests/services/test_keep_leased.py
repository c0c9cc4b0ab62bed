"""A Rollout call longer than the prompt queue's lease keeps its prompts (``ServiceBase.keep_leased``): the lease is
renewed while the call runs, so the prompts are acked on time instead of redelivered and generated again."""

from __future__ import annotations

import threading

from relax_queue import Capacity, QueueConfig, TransferQueue
from relax_services.services._base import ServiceBase

LEASE_S = 1.0  # renewed every 0.1 s: a stall of a whole second on a loaded machine is needed to break it


def _queue_with_a_row() -> TransferQueue:
    q = TransferQueue(QueueConfig(tasks=("rollout",), capacity=Capacity(max_rows=4), lease_timeout_s=LEASE_S))
    q.put("p0", {"x": 0})
    return q


def test_a_batch_held_past_its_lease_is_acked_on_time_while_kept_leased() -> None:
    service = ServiceBase("rollout-test", None)
    q = _queue_with_a_row()
    reader = q.reader("rollout", fields=["x"])
    batch = reader.get(timeout=10)
    with service.keep_leased(reader, batch, every_s=LEASE_S / 10):
        threading.Event().wait(2.5 * LEASE_S)  # the call outlasts two leases
    assert service.ack(reader, batch) is True
    assert not any(t.name == "rollout-test-lease" for t in threading.enumerate())  # the renewing thread is joined


def test_without_it_the_same_hold_is_a_late_ack() -> None:
    service = ServiceBase("rollout-test", None)
    q = _queue_with_a_row()
    reader = q.reader("rollout", fields=["x"])
    batch = reader.get(timeout=10)
    threading.Event().wait(2.5 * LEASE_S)
    assert service.ack(reader, batch) is False  # expired: the prompts would be redelivered
