"""The heartbeat collector of a run, in a module of its own: its actor process imports this alone, not the
services' model stack (torch, transformers), so it starts in well under a second and stays small."""

from __future__ import annotations

import time
from typing import TypedDict

__all__ = ["Beat", "HealthMonitor"]


class _Record(TypedDict):
    progress: int
    pid: int
    changed: float  # monotonic time the progress counter last moved (a hung loop stops moving it)
    beat: float  # monotonic time of the newest beat
    error: str | None


class Beat(_Record):
    """The newest heartbeat of one service, as :meth:`HealthMonitor.snapshot` reports it (times: the monitor's
    monotonic clock; compare the ages only)."""

    since_change_s: float  # seconds since the progress counter last moved
    since_beat_s: float  # seconds since the newest beat


class HealthMonitor:
    """Collects heartbeats (a Ray actor with ``num_cpus=0``; plain object in unit tests).

    A beat carries the service's progress counter (work-loop iterations), so a hung loop is told apart from a
    live process: its counter stops moving. Times are this process's monotonic clock; :meth:`snapshot` turns them
    into ages, so the reader compares durations, never clocks of two processes or nodes.
    """

    def __init__(self) -> None:
        self._beats: dict[str, _Record] = {}

    def beat(self, name: str, progress: int, pid: int, error: str | None = None) -> None:
        """Record a heartbeat of ``name`` (its progress counter, process id and loop error, if any)."""
        now = time.monotonic()
        entry = self._beats.get(name)
        if entry is None or entry["pid"] != pid or entry["progress"] != progress:
            self._beats[name] = {"progress": progress, "pid": pid, "changed": now, "beat": now, "error": error}
        else:
            entry["beat"] = now
            entry["error"] = error or entry["error"]

    def forget(self, name: str) -> None:
        """Drop a service's record (before it is restarted, so the new instance starts fresh)."""
        self._beats.pop(name, None)

    def snapshot(self) -> dict[str, Beat]:
        """Each service's last beat, with ``since_change_s`` (since its progress last moved) and ``since_beat_s``."""
        now = time.monotonic()
        return {
            name: Beat(**entry, since_change_s=now - entry["changed"], since_beat_s=now - entry["beat"])
            for name, entry in self._beats.items()
        }
