"""Starting Ray for a run (a local instance that cannot outlive the driver), or joining a cluster."""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

from relax_services.hosting.reaper import start_reaper
from relax_services.hosting.worker_setup import WORKER_SETUP_HOOK

__all__ = [
    "ACTOR_ENV",
    "LOCAL_SYSTEM_CONFIG",
    "UNUSED_HEAD_PROCESSES",
    "alive",
    "init_ray",
    "stop_unused_head_processes",
    "wait_gone",
]

logger = logging.getLogger(__name__)

_REAPER: Any = None

_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
"""The logger of Ray's notice that a new local instance has token authentication on."""


class _DropAuthNotice(logging.Filter):
    """Drops Ray's "Token authentication is enabled for this Ray cluster" notice (a local instance of the run)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled")


ACTOR_ENV: dict[str, str] = {
    # One thread per process: under CPU contention more threads made forwards 20-50x slower (DESIGN.md field notes).
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # glibc gives each thread that allocates an arena of its own (up to 8 per core) and a service process has
    # several (its work loop, Ray's task and I/O threads); two bound that growth. Measured on the default run at 2
    # cores: no change of the peak (the arenas stay small there). Fixed mmap and trim thresholds were measured too and
    # left out: 30-40 MB less PSS per model process at the peak, but 18 % slower training updates
    # (benchmarks/malloc_env.py).
    "MALLOC_ARENA_MAX": "2",
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
    # The setup hook keeps triton out of every worker on a machine without a GPU (see ``_worker_setup``).
    env = {"env_vars": dict(ACTOR_ENV), "worker_process_setup_hook": WORKER_SETUP_HOOK}
    if address is None:
        # A local Ray must not outlive this process, even if it is SIGKILLed: a watchdog ends what is left. It
        # lives as long as this module holds it (its pipe closes when this process ends, however it ends).
        global _REAPER
        if _REAPER is None:
            _REAPER = start_reaper()
        # Ray turns token authentication on for a new local instance when RAY_AUTH_MODE is unset (a token under
        # ~/.ray, made once) and says so on every start. This instance is the run's own, reachable only while the
        # run lives: its notice is dropped, Ray's setting kept (RAY_AUTH_MODE, when set, decides as usual). A
        # cluster joined with --ray-address keeps Ray's notices.
        auth_log = logging.getLogger(_AUTH_LOGGER)
        notice = _DropAuthNotice()
        auth_log.addFilter(notice)
        try:
            ray.init(
                include_dashboard=False,
                log_to_driver=False,
                runtime_env=env,
                configure_logging=False,
                _system_config=dict(LOCAL_SYSTEM_CONFIG),
            )
        finally:
            auth_log.removeFilter(notice)
        stop_unused_head_processes()
        return True
    _probe(address)
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, runtime_env=env)
    except Exception as exc:  # whatever Ray raises for an unreachable or wrong address, report it as one error
        raise ConnectionError(f"cannot reach the Ray cluster at --ray-address {address!r}: {exc}") from exc
    return True


UNUSED_HEAD_PROCESSES: tuple[str, ...] = ("monitor", "log_monitor", "dashboard")
"""Head processes of a local Ray that relax does not use, stopped once it is up: the autoscaler monitor (a local
instance has a fixed set of CPUs), the log monitor (it streams worker output to the driver, which
``log_to_driver=False`` turns off; the workers still write their log files), and the dashboard head (the HTTP
server of the dashboard, job submission and state API; ``include_dashboard=False`` still starts it with a
minimal set of modules). None of them is fate-shared with the raylet or GCS. Measured: 47 + 46 + 55 MB PSS."""


def stop_unused_head_processes() -> list[str]:
    """Stop the :data:`UNUSED_HEAD_PROCESSES` of the local Ray this process started; returns those stopped.

    Ray's ``ray.init`` has no setting for them (``ray start`` has ``--no-monitor`` and ``--include-log-monitor``
    only), so this asks the node object ``ray.init`` made to end them, as Ray's own tests do
    (``Node.kill_monitor`` and the like); the node forgets each one, so ``ray.shutdown`` does not look for it. A
    process this Ray version does not start, or one already gone, is left out. Does nothing when this process
    joined a cluster instead.
    """
    import ray._private.worker as ray_worker

    node = getattr(ray_worker, "_global_node", None)
    if node is None or not node.head:
        return []
    if not callable(getattr(node, "_kill_process_type", None)) or not isinstance(
        getattr(node, "all_processes", None), dict
    ):
        # A Ray version without these private names: its head keeps those processes (memory only, nothing breaks).
        logger.debug("this Ray version's node object cannot stop head processes; left running")
        return []
    stopped = []
    for process_type in UNUSED_HEAD_PROCESSES:
        if process_type in node.all_processes:
            # SIGKILL, not SIGTERM: the autoscaler monitor reports a SIGTERM as its own failure, which the raylet
            # then prints on the driver's console.
            node._kill_process_type(process_type, allow_graceful=False, check_alive=False)
            stopped.append(process_type)
    return stopped


def _probe(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast on a ``host:port`` nobody listens on (Ray itself keeps retrying for minutes)."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto" or another form Ray resolves itself
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConnectionError(f"cannot reach the Ray cluster at --ray-address {address!r}: {exc}") from exc


def wait_gone(pid: int, timeout_s: float = 60.0, poll_s: float = 0.05) -> bool:
    """Wait until process ``pid`` (of this machine) has ended, at most ``timeout_s``; returns whether it did."""
    deadline = time.monotonic() + timeout_s
    while alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


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
