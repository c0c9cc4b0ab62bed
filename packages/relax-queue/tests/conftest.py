"""Shared fixtures. Ray tests use the repository-wide ``ray_session`` fixture (root conftest.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from relax_queue import BoundedStaleness, Capacity, QueueConfig, TaskSpec, TransferQueue


def _make_queue(
    tasks: tuple[str | TaskSpec, ...] = ("a", "b"),
    max_rows: int | None = 100,
    max_bytes: int | None = None,
    tau: int | None = None,
    on_stale: str = "drop",
    batch_size: int = 1,
    lease_timeout_s: float = 30.0,
) -> TransferQueue:
    """A queue with the given parts (a test helper, not part of the package)."""
    return TransferQueue(
        QueueConfig(
            tasks=tasks,
            capacity=Capacity(max_rows=max_rows, max_bytes=max_bytes),
            staleness=BoundedStaleness(tau=tau, on_stale=on_stale, batch_size=batch_size),  # type: ignore[arg-type]
            lease_timeout_s=lease_timeout_s,
        )
    )


MakeQueue = Callable[..., TransferQueue]


@pytest.fixture
def make_queue() -> MakeQueue:
    """Factory of queues built from the given parts (see ``_make_queue``)."""
    return _make_queue
