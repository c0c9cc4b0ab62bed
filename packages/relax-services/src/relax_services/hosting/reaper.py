"""A watchdog that ends a local Ray instance when the ``relax`` process that started it dies, even by SIGKILL.

Ray's head processes started by ``ray.init`` exit with their driver, but some of their helpers (the dashboard
and runtime-env agents, idle workers) are reparented to PID 1 and live on. ``relax train`` therefore starts
this small process first (``python -m relax_services.hosting.reaper``, no torch, no ray): it holds the read end of a
pipe whose write end only the driver has, so the read returns when the driver is gone, however it ended. Every
second until then it notes the driver's descendants (pid and start time); afterwards it SIGKILLs those still
alive whose start time matches (a reused pid is left alone). After a clean ``ray.shutdown`` none is left and it
just exits. Linux only (``/proc``); elsewhere it watches nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

__all__ = ["start_reaper"]


def _stat(pid: int) -> tuple[int, int] | None:
    """``(parent pid, start time)`` of ``pid`` from ``/proc``, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ... starttime is field 22
    return int(fields[1]), int(fields[19])


def _descendants(root: int) -> dict[int, int]:
    """Every live descendant of ``root``: pid → start time."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (info := _stat(int(entry))) is not None:
            children.setdefault(info[0], []).append(int(entry))
            starts[int(entry)] = info[1]
    out: dict[int, int] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid in starts and pid != os.getpid():
            out[pid] = starts[pid]
            todo.extend(children.get(pid, []))
    return out


def _watch(driver: int, interval_s: float = 1.0) -> None:
    known: dict[int, int] = {}
    gone = threading.Event()

    def wait_for_eof() -> None:
        sys.stdin.buffer.read()  # returns when every write end is closed: the driver exited
        gone.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    while not gone.wait(interval_s):
        known.update(_descendants(driver))
    for pid, started in known.items():
        info = _stat(pid)
        if info is not None and info[1] == started:
            with contextlib.suppress(OSError):  # ended meanwhile
                os.kill(pid, signal.SIGKILL)


def start_reaper() -> subprocess.Popen[bytes] | None:
    """Start the watchdog for this process (call before starting Ray); None where ``/proc`` is missing."""
    if not Path("/proc/self/stat").is_file():
        return None
    return subprocess.Popen(
        [sys.executable, "-m", "relax_services.hosting.reaper", str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C to the terminal's process group reaches the driver, not this
        close_fds=True,
    )


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watch(int(sys.argv[1]))
