"""Starting Ray for a run (a local instance that cannot outlive the driver), or joining a cluster."""

from __future__ import annotations

import os
import socket
from typing import Any

from relax_services._reaper import start_reaper

__all__ = ["ACTOR_ENV", "LOCAL_SYSTEM_CONFIG", "alive", "init_ray"]

_REAPER: Any = None

ACTOR_ENV: dict[str, str] = {
    # One thread per process: under CPU contention more threads made forwards 20-50x slower (DESIGN.md field notes).
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # glibc gives each thread that allocates its own arena (up to 8 per core) and, once a large block has been
    # freed, raises its mmap threshold up to 32 MiB, so later tensor-sized blocks come from arenas that fragment and
    # never shrink. Two arenas, a fixed 128 KiB mmap threshold (blocks above it are unmapped when freed) and a 1 MiB
    # trim threshold keep each process's heap near what it uses: measured on the default run, 25-40 MB less PSS per
    # model process and 30 MB per queue actor at the peak.
    "MALLOC_ARENA_MAX": "2",
    "MALLOC_MMAP_THRESHOLD_": "131072",
    "MALLOC_TRIM_THRESHOLD_": "1048576",
}
"""Environment of every Ray worker process of a run (the job's ``runtime_env``; set before the process starts, so
glibc reads the ``MALLOC_*`` settings)."""

LOCAL_SYSTEM_CONFIG: dict[str, object] = {
    # Ray starts one idle worker per CPU when the first driver connects; every service is an actor with a worker
    # of its own, so those idle workers only held memory (2 x 44 MB PSS on 2 cores).
    "prestart_worker_first_driver": False,
    # Task events feed Ray's dashboard and state API, which relax does not use; 0 stops recording and reporting
    # them, so GCS no longer keeps up to 100,000 events of the run's actor calls (its PSS grew to 187 MB).
    "task_events_report_interval_ms": 0,
}
"""Ray system config of a local instance started by :func:`init_ray` (a cluster keeps the settings it was
started with)."""


def init_ray(address: str | None) -> bool:
    """Start a local Ray instance, or join the cluster at ``address``; True when this call started Ray."""
    import ray

    if ray.is_initialized():
        return False
    env = {"env_vars": dict(ACTOR_ENV)}
    if address is None:
        # A local Ray must not outlive this process, even if it is SIGKILLed: a watchdog ends what is left. It
        # lives as long as this module holds it (its pipe closes when this process ends, however it ends).
        global _REAPER
        if _REAPER is None:
            _REAPER = start_reaper()
        ray.init(
            include_dashboard=False,
            log_to_driver=False,
            runtime_env=env,
            configure_logging=False,
            _system_config=dict(LOCAL_SYSTEM_CONFIG),
        )
        return True
    _probe(address)
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, runtime_env=env)
    except Exception as exc:  # whatever Ray raises for an unreachable or wrong address, report it as one error
        raise ConnectionError(f"cannot reach the Ray cluster at --ray-address {address!r}: {exc}") from exc
    return True


def _probe(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast on a ``host:port`` nobody listens on (Ray itself keeps retrying for minutes)."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto" or another form Ray resolves itself
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConnectionError(f"cannot reach the Ray cluster at --ray-address {address!r}: {exc}") from exc


def alive(pid: int) -> bool:
    """Whether process ``pid`` still exists (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
