"""Checkpoints are crash-consistent: a crash while writing leaves the previous checkpoint loadable."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relax_services.checkpoint import (
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
