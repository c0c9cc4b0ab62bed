"""A checkpoint that cannot be written (a full disk) ends the run cleanly: the partial folder is removed, the
earlier checkpoint stays the latest, the metrics and summary are still written, and the message says how to go on."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest

from relax_services.control.checkpoint import CheckpointManager
from relax_services.reporting.metrics import read_metrics


@pytest.mark.integration
def test_disk_full_at_a_checkpoint(small_config, run_pipeline, monkeypatch: pytest.MonkeyPatch) -> None:
    from relax_services.control import checkpointing as _checkpointing  # the controller's checkpoint writing

    real_write = _checkpointing.write_controller_state

    def write(path: Path, state: Any) -> None:
        # The controller writes its state last into a ".tmp-step_…" folder; from step 1 on, the disk is "full".
        if path.parent.name.startswith(".tmp-step_") and "step_00000000" not in path.parent.name:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_write(path, state)

    monkeypatch.setattr(_checkpointing, "write_controller_state", write)
    cfg = small_config("staleness.tau=0", "trainer.total_steps=6", "trainer.checkpoint_every=1", "data.tasks=[text]")
    result = run_pipeline(cfg)
    assert result.error is not None and "the disk is full" in result.error, result.error
    assert "step_00000000" in result.error and "--resume" in result.error
    assert result.stop_reason == "checkpoint write failed"
    folder = result.run_dir / "checkpoints"
    assert [p.name for p in folder.iterdir()] == ["step_00000000"]  # no partial ".tmp-step_…" folder is left
    assert CheckpointManager(folder).latest() == folder / "step_00000000"
    assert list(read_metrics(result.run_dir / "metrics.jsonl", "summary"))  # the run's record is complete
