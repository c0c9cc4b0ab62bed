"""The watchdog that ends what a SIGKILLed ``relax`` process leaves behind (Ray's agents, workers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="the watchdog reads /proc")

_DRIVER = """
import subprocess, sys, time
from pathlib import Path
from relax_services.hosting.reaper import start_reaper
start_reaper()
sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
# a child, and a grandchild in a session of its own (as Ray's agents end up, reparented to PID 1)
child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
    "p = subprocess.Popen(sys.argv[1:], start_new_session=True); print(p.pid, flush=True); time.sleep(600)", *sleep],
    stdout=subprocess.PIPE, text=True)
grandchild = int(child.stdout.readline())
time.sleep(2.5)  # the watchdog notes the family every second
Path(sys.argv[1]).write_text(f"{child.pid} {grandchild}")
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_sigkilled_driver_leaves_no_process_behind(tmp_path: Path) -> None:
    marker = tmp_path / "family"
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER, str(marker)])
    try:
        deadline = time.monotonic() + 120
        while not marker.is_file() and time.monotonic() < deadline and driver.poll() is None:
            time.sleep(0.2)
        child, grandchild = (int(p) for p in marker.read_text().split())
        assert _alive(child) and _alive(grandchild)
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        deadline = time.monotonic() + 30
        while (_alive(child) or _alive(grandchild)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(child) and not _alive(grandchild)
    finally:
        for pid in (driver.pid,):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
