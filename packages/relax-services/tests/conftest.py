"""Shared fixtures of the relax-services tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

# Under `uv run`, Ray's uv hook would start every worker through `uv run` in a copied working dir, which
# hangs offline; the workers must use this environment's interpreter. Read by Ray at import time.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")


@pytest.fixture(scope="session")
def ray_session() -> Iterator[Any]:
    """One local Ray instance for the whole test session, shut down at the end."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
