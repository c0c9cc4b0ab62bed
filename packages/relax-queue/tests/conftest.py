"""Shared fixtures. Ray starts once per session, only when a Ray test asks for it."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

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


@pytest.fixture(scope="session")
def ray_session() -> Iterator[Any]:
    """One local Ray instance for the whole test session, shut down at the end."""
    # Under `uv run`, Ray would start every worker through `uv run` with a packaged working
    # directory (slow enough on a busy machine that workers miss their registration timeout).
    # Read when ray is imported, so set it first.
    os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
    ray = pytest.importorskip("ray")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        object_store_memory=300 * 1024 * 1024,
        namespace="relax-queue-tests",
    )
    try:
        yield ray
    finally:
        ray.shutdown()
