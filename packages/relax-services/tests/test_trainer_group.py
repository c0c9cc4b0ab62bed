"""The Trainer as a group of Ray actors: it trains as one process does, and a rank that dies fails the group."""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from relax_services.engines import LossInputs, TorchTrainEngine, TrainEngine
from relax_services.models import build_tiny_omni
from relax_services.trainer_group import TrainerGroup, TrainerGroupConfig, TrainerGroupFailed


def _load_worker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_fsdp_worker", Path(__file__).with_name("_fsdp_worker.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


worker = _load_worker()
ATOL = 5e-5  # as in test_engines_fsdp.py: float summation order across ranks


def crash_on_rank_1(inputs: LossInputs) -> torch.Tensor:
    """The policy-gradient loss, except that rank 1's process dies in the middle of the update."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(3)
    return worker.pg_token_mean(inputs)[0]


def test_bad_group_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="world_size"):
        TrainerGroupConfig(world_size=0)
    with pytest.raises(ValueError, match="backend"):
        TrainerGroupConfig(backend="mpi")  # type: ignore[arg-type]


@pytest.mark.integration
def test_a_two_rank_group_trains_like_one_process_and_fails_whole(ray_session: Any) -> None:
    group = TrainerGroup(
        functools.partial(build_tiny_omni, 0),
        worker.CONFIG,
        group=TrainerGroupConfig(world_size=2, num_cpus_per_rank=0, step_timeout_s=240),
    )
    try:
        assert isinstance(group, TrainEngine)
        metrics = group.step(worker.batch(0), worker.pg_token_mean)
        reference = TorchTrainEngine(build_tiny_omni(0), worker.CONFIG)
        ref_metrics = reference.step(worker.batch(0), worker.pg_token_mean)
        assert metrics["loss"] == pytest.approx(ref_metrics["loss"], rel=1e-5)
        weights, ref_weights = group.policy_state(), reference.policy_state()
        assert max(float((weights[k] - ref_weights[k]).abs().max()) for k in ref_weights) < ATOL
        assert group.version == 1

        with pytest.raises(TrainerGroupFailed, match="rank 1 failed in step"):
            group.step(worker.batch(1), crash_on_rank_1)
        assert not group.alive
        assert group.version == 1  # the broken update produced no version
        with pytest.raises(TrainerGroupFailed, match="failed earlier"):
            group.policy_state()  # nothing from the broken update can be published
    finally:
        group.shutdown()
