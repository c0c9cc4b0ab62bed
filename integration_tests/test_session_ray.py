"""The test session's Ray instance (``ray_session`` of the root conftest.py): its workers run with one intra-op
thread and without Ray's uv hook, the environment every engine and service of the tests assumes."""

from __future__ import annotations

import os
from typing import Any

import pytest


@pytest.mark.integration
def test_the_session_s_actors_run_with_the_worker_environment(ray_session: Any) -> None:
    ray = ray_session

    @ray.remote(num_cpus=0)
    class Probe:
        def environ(self) -> dict[str, str | None]:
            import os

            names = ("OMP_NUM_THREADS", "RAY_ENABLE_UV_RUN_RUNTIME_ENV")
            return {"pid": str(os.getpid()), **{name: os.environ.get(name) for name in names}}

    probes = [Probe.remote() for _ in range(3)]  # the prestarted workers and fresh ones alike
    try:
        seen = ray.get([p.environ.remote() for p in probes], timeout=120)
    finally:
        for probe in probes:
            ray.kill(probe)
    assert all(s["OMP_NUM_THREADS"] == "1" and s["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] == "0" for s in seen), seen
    pids = {s["pid"] for s in seen}
    assert len(pids) == 3 and str(os.getpid()) not in pids, seen  # each actor in a worker process of its own
