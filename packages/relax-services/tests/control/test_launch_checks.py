"""What ``launch`` refuses before Ray starts: an FSDP2 Trainer on a torch whose FSDP2 lacks a method the engine calls
(a GPU machine's torch 2.11 did; each rank used to find out alone, inside its actor)."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax_services.config import load_run_config
from relax_services.control.launch import LaunchError, launch
from relax_services.engines.fsdp import train as fsdp_train


def test_an_fsdp2_that_lacks_a_method_the_engine_calls_is_refused_before_ray(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    assert fsdp_train.fsdp2_lacks() is None  # the locked torch has every method
    monkeypatch.setattr(fsdp_train, "FSDP2_METHODS", (*fsdp_train.FSDP2_METHODS, "set_no_such_thing"))
    cfg = load_run_config(None, ["trainer.engine=fsdp", "trainer.world_size=2", f"run.output_dir={tmp_path}"])
    was_up = ray.is_initialized()
    with pytest.raises(LaunchError, match=r"FSDPModule\.set_no_such_thing, which torch \S+ lacks"):
        launch(cfg, tmp_path)
    assert ray.is_initialized() == was_up and not any(tmp_path.iterdir())
