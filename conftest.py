"""Test-session fixtures shared by every package and the integration tests.

Ray starts once per test session, only when a test asks for it (``ray_session``), and is shut down at the end.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest

# Under `uv run`, Ray's uv hook would start every worker through `uv run` in a copied working directory, which
# fails offline; workers must use this environment's interpreter. Ray reads this when it is imported.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")

INTEGRATION_TIMEOUT_S = 900
"""pytest-timeout's limit for ``integration``-marked tests (unit tests keep the ``timeout`` of the pytest config).

They start Ray and several service processes that each import the model stack: on a 4-5x overloaded 2-core machine
that alone can pass the unit tests' 300 s, and pytest-timeout's signal then lands inside a Ray call (seen as a
``SystemError``) instead of failing the test for a reason of its own. A test's own ``timeout`` marker still wins."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("integration") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(INTEGRATION_TIMEOUT_S))


WORKER_ENV = {"OMP_NUM_THREADS": "1", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
"""The environment of every worker process of the session's Ray instance."""


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` updated with ``values`` inside the block, as it was after it."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="session")
def ray_session() -> Iterator[Any]:
    """One local Ray instance for the whole test session (light actors use ``num_cpus=0``).

    Its workers get :data:`WORKER_ENV` from the environment of the raylet that ``ray.init`` starts, not from a job
    ``runtime_env``: with one, Ray's runtime-env agent sets up every new worker process before it may take an actor
    (measured on 2 cores: 1.8-3 s an actor, against 0.2-0.8 s without), and the idle workers Ray prestarts cannot
    take actors at all. Every test's actors start that much sooner; what runs in them is the same.
    """
    ray = pytest.importorskip("ray")
    if ray.is_initialized():  # pragma: no cover - a package-level fixture started it
        yield ray
        return
    with _environ(WORKER_ENV):  # the raylet starts now and passes its environment on to every worker
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
            object_store_memory=512 * 1024 * 1024,
        )
    try:
        yield ray
    finally:
        ray.shutdown()
