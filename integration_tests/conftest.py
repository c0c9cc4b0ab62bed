"""Fixtures of the integration tests: small, fast pipeline runs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from relax_services.config import RunConfig, load_run_config
from relax_services.controller import Controller, RunResult

FAST = [
    "data.train_per_task=16",
    "data.eval_per_task=8",
    "trainer.groups_per_step=4",
    "trainer.micro_batch_groups=2",
    "trainer.target_reward=null",
    "trainer.max_minutes=5",
    "trainer.warmup_format_steps=0",
    "rollout.groups_per_call=2",
    "eval.every_steps=1000",
    "run.progress=none",
    "algorithm.group_size=4",
]


@pytest.fixture
def small_config(tmp_path: Path) -> Callable[..., RunConfig]:
    """Factory: a fast run config writing under the test's tmp_path, plus the given dotted overrides."""

    def make(*overrides: str) -> RunConfig:
        return load_run_config(None, [*FAST, f"run.output_dir={tmp_path}", "run.name=run", *overrides])

    return make


@pytest.fixture
def run_pipeline(ray_session: object) -> Callable[[RunConfig], RunResult]:
    """Runs a config to its end with the session's Ray instance; returns the run's result."""

    def run(cfg: RunConfig) -> RunResult:
        run_dir = cfg.run.output_dir / (cfg.run.name or "run")
        run_dir.mkdir(parents=True, exist_ok=True)
        return Controller(cfg, run_dir).run()

    return run
