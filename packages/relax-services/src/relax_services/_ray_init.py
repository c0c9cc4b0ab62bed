"""Starting Ray for a run (a local instance that cannot outlive the driver), or joining a cluster."""

from __future__ import annotations

import os
import socket
from typing import Any

from relax_services._reaper import start_reaper

__all__ = ["alive", "init_ray"]

_REAPER: Any = None


def init_ray(address: str | None) -> bool:
    """Start a local Ray instance, or join the cluster at ``address``; True when this call started Ray."""
    import ray

    if ray.is_initialized():
        return False
    env = {"env_vars": {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}}
    if address is None:
        # A local Ray must not outlive this process, even if it is SIGKILLed: a watchdog ends what is left. It
        # lives as long as this module holds it (its pipe closes when this process ends, however it ends).
        global _REAPER
        if _REAPER is None:
            _REAPER = start_reaper()
        ray.init(include_dashboard=False, log_to_driver=False, runtime_env=env, configure_logging=False)
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
