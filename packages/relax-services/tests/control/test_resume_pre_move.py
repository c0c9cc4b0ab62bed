"""A run checkpoint written before the package's folders were laid out resumes with today's code.

The fixture ``fixtures/pre_move_run`` is a colocated run of two updates on the text task (the saved config and
its step-2 checkpoint: engine state, both queue snapshots, the controller's pickle), written by the code of
de7ea69, when every module of the package sat in its root. Pickles name their classes by module path, so a class
that moved without a way back would fail to load here.

A run's dataset stream records its files by absolute path, and the fixture's synthetic files lay in the model cache
of the machine that wrote it (``/root/.cache/relax``): the resumed run uses that cache folder (it writes the same
files there again when they are missing), and the test is skipped where that folder cannot be written.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest

from relax_services.config.resume import resume_config
from relax_services.control.checkpoint import CONTROLLER_FILE, CheckpointManager
from relax_services.control.colocated import ColocatedController

FIXTURE = Path(__file__).with_name("fixtures") / "pre_move_run"
SAVED_STEP = 2
SAVED_CACHE = Path("/root/.cache/relax")  # $RELAX_CACHE_DIR of the run that wrote the fixture


def test_the_fixture_is_a_checkpoint_of_the_old_code() -> None:
    checkpoint = FIXTURE / "checkpoints" / f"step_{SAVED_STEP:08d}"
    state = CheckpointManager.load_controller(checkpoint)
    assert state["step"] == SAVED_STEP
    with open(checkpoint / CONTROLLER_FILE, "rb") as f:
        assert pickle.load(f)["step"] == SAVED_STEP
    assert CheckpointManager(FIXTURE / "checkpoints").latest() == checkpoint


@pytest.mark.integration
def test_a_checkpoint_from_before_the_move_resumes_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        SAVED_CACHE.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        pytest.skip(f"the fixture's dataset files live under {SAVED_CACHE}, which cannot be written here: {exc}")
    monkeypatch.setenv("RELAX_CACHE_DIR", str(SAVED_CACHE))
    run_dir = tmp_path / "pre_move"
    shutil.copytree(FIXTURE, run_dir)
    steps = SAVED_STEP + 2
    cfg, changed = resume_config(run_dir, None, [f"run.output_dir={tmp_path}", f"trainer.total_steps={steps}"])
    assert changed["trainer.total_steps"] == (SAVED_STEP, steps)
    result = ColocatedController(cfg, run_dir, resume=True).run()

    assert result.steps == steps
    latest = CheckpointManager(run_dir / "checkpoints").latest()
    assert latest is not None and latest.name == f"step_{steps:08d}"
    assert CheckpointManager.load_engine(latest)["version"] == steps
    # the restored ledger continues the saved one: every prompt of the old run is accounted for, none twice
    assert result.ledger["lost"] == 0 and result.ledger["duplicated"] == 0
    old = CheckpointManager.load_controller(FIXTURE / "checkpoints" / f"step_{SAVED_STEP:08d}")["feeder"]["ledger"]
    new = CheckpointManager.load_controller(latest)["feeder"]["ledger"]
    assert set(old["generated"]) <= set(new["generated"])
    assert all(new["consumed"][key] >= count for key, count in old["consumed"].items())
