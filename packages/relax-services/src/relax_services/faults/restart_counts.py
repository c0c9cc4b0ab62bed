"""What an in-place restart counts against (``health.max_restarts``), for services in their own processes and for
roles sharing one (``run.hosts``), and the one shape of the health manager's ``restarted`` event.

A service's count is its own failures: a loop that raised (rebuilt in its process, or in a new one when that
fails), a loop that hung, a process of its own that died. A shared host has a count of its own, its replacements by
a new process: a host that died counts against the host alone (the process failed, not any of its roles: a Reward
that raised three times is not spent when its fellow Rollout's process is killed), and a host replaced because one
of its roles hung, or could not be rebuilt inside it, counts against the host and that role. Either count past
``health.max_restarts`` makes the next such failure a global restart from the last checkpoint. The backoff before a
restart doubles with the largest count it goes against.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["Counted", "backoff_s", "charged", "restarted_event", "spent"]


class Counted(Protocol):
    """Whatever has a restart count: a service's record, or a shared host."""

    @property
    def name(self) -> str:
        """The service's or the host's name, as restart events name it."""
        ...

    restarts: int


def charged(service: Counted, host: Counted | None, died: bool) -> list[Counted]:
    """The counts one restart goes against.

    Args:
        service: The service whose failure was detected.
        host: Its shared host when the restart replaces that host's process; None for a restart of ``service``
            alone (its own process, or a rebuild inside its host).
        died: Whether the process died (rather than one service in it raising or hanging).

    Returns:
        ``[service]`` for a restart of the service alone; ``[host]`` for a host that died; ``[host, service]`` for a
        host replaced because of ``service``.
    """
    if host is None:
        return [service]
    return [host] if died else [host, service]


def backoff_s(base_s: float, counts: Sequence[Counted]) -> float:
    """The wait before a restart: ``health.restart_backoff_s`` doubled per restart of the most restarted of
    ``counts``."""
    most: int = max((c.restarts for c in counts), default=0)
    return base_s * float(2**most)


def spent(counts: Sequence[Counted], max_restarts: int) -> Counted | None:
    """The first of ``counts`` that has used up ``health.max_restarts`` (its next failure is a global restart)."""
    return next((c for c in counts if c.restarts >= max_restarts), None)


def restarted_event(
    restarts: int, pid: int | None, seconds: float, process: str, host: Counted | None
) -> dict[str, object]:
    """The fields of one ``restarted`` health event, whatever restarted the service.

    Args:
        restarts: The service's own count after this restart (see :func:`charged`).
        pid: Its process id now.
        seconds: From the start of the restart (backoff included) until its work loop ran again.
        process: ``"same"`` (rebuilt in its live process) or ``"new"``.
        host: The shared host it runs in, or None (a process of its own).

    Returns:
        ``restarts``, ``pid``, ``seconds``, ``process``, ``host`` (its name or None) and ``host_restarts`` (the
        host's replacements so far, or None).
    """
    return {
        "restarts": restarts,
        "pid": pid,
        "seconds": seconds,
        "process": process,
        "host": None if host is None else host.name,
        "host_restarts": None if host is None else host.restarts,
    }
