"""Checkpoints are crash-consistent: a crash while writing leaves the previous checkpoint loadable."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relax_services.control.checkpoint import (
    CONTROLLER_FILE,
    ENGINE_FILE,
    PROMPTS_FILE,
    SAMPLES_FILE,
    CheckpointManager,
)


def _write(manager: CheckpointManager, step: int) -> Path:
    tmp = manager.begin(step)
    torch.save({"version": step, "model": {"w": torch.full((2,), float(step))}}, tmp / ENGINE_FILE)
    torch.save({"step": step}, tmp / CONTROLLER_FILE)
    (tmp / PROMPTS_FILE).write_bytes(b"p")
    (tmp / SAMPLES_FILE).write_bytes(b"s")
    return manager.commit(step, tmp)


def test_keeps_the_newest_and_prunes(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep=2)
    for step in (1, 2, 3):
        _write(manager, step)
    assert manager.steps() == [2, 3]
    latest = manager.latest()
    assert latest == manager.path(3)
    assert CheckpointManager.load_engine(latest)["model"]["w"].tolist() == [3.0, 3.0]


def test_crash_mid_write_leaves_previous_checkpoint(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep=3)
    _write(manager, 1)
    # A crash after some files of step 2 were written, before the rename: only a temporary folder remains.
    tmp = manager.begin(2)
    torch.save({"version": 2}, tmp / ENGINE_FILE)
    assert manager.steps() == [1]
    assert manager.latest() == manager.path(1)
    # A step folder whose engine file was cut short (e.g. the disk filled) is skipped, not loaded.
    _write(manager, 3)
    engine = manager.path(3) / ENGINE_FILE
    engine.write_bytes(engine.read_bytes()[:20])
    assert manager.latest() == manager.path(1)
    assert CheckpointManager.load_engine(manager.latest())["version"] == 1


def test_incomplete_commit_is_refused(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    tmp = manager.begin(5)
    torch.save({}, tmp / ENGINE_FILE)
    with pytest.raises(RuntimeError, match="incomplete"):
        manager.commit(5, tmp)
    assert manager.steps() == []


_FIND_LATEST = """
import importlib.abc, json, sys
from pathlib import Path

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError(f"blocked import of {name}")
        return None

sys.meta_path.insert(0, Blocker())
from relax_services.control.checkpoint import CheckpointManager

manager = CheckpointManager(Path(sys.argv[1]), keep=5)
latest = manager.latest()
print(json.dumps({"latest": latest.name, "state": manager.load_controller(latest)}))
"""


def test_the_controller_finds_and_reads_checkpoints_without_torch(tmp_path: Path) -> None:
    # The controller writes its state as a plain pickle and checks the trainer's engine archive by its checksums:
    # before, finding the latest checkpoint loaded every engine state (model and optimizer) with torch.
    import json
    import subprocess
    import sys

    from relax_services.control.checkpoint import write_controller_state

    manager = CheckpointManager(tmp_path, keep=5)
    for step in (1, 2, 3):
        tmp = manager.begin(step)
        torch.save({"version": step, "model": {"w": torch.full((64,), float(step))}}, tmp / ENGINE_FILE)
        write_controller_state(tmp / CONTROLLER_FILE, {"step": step, "feeder": {"next_index": 10 * step}})
        (tmp / PROMPTS_FILE).write_bytes(b"p")
        (tmp / SAMPLES_FILE).write_bytes(b"s")
        manager.commit(step, tmp)
    engine = manager.path(3) / ENGINE_FILE
    engine.write_bytes(engine.read_bytes()[:-40])  # cut short: its archive no longer closes
    damaged = bytearray((manager.path(2) / ENGINE_FILE).read_bytes())
    start = bytes(damaged).index(b"\x00\x00\x00\x40" * 64)  # step 2's tensor: 64 float32 2.0s, stored as they are
    damaged[start : start + 4] = b"\x00\x00\x80\x3f"  # its first value now 1.0: the member's checksum fails
    (manager.path(2) / ENGINE_FILE).write_bytes(bytes(damaged))
    out = subprocess.run([sys.executable, "-c", _FIND_LATEST, str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout) == {"latest": "step_00000001", "state": {"step": 1, "feeder": {"next_index": 10}}}
    assert CheckpointManager.load_controller(manager.path(1)) == {"step": 1, "feeder": {"next_index": 10}}
