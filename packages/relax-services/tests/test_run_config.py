"""Derived run settings."""

from __future__ import annotations

import pytest

from relax_services.config import load_run_config


@pytest.mark.parametrize(
    ("groups_per_step", "groups_per_call", "expected"),
    [(32, 16, 16), (4, 16, 4), (12, 8, 6), (6, 4, 3), (7, 4, 1), (32, 1, 1)],
)
def test_rollout_call_groups_divide_an_update(groups_per_step: int, groups_per_call: int, expected: int) -> None:
    cfg = load_run_config(
        None,
        [
            f"trainer.groups_per_step={groups_per_step}",
            f"trainer.micro_batch_groups={groups_per_step}",
            f"rollout.groups_per_call={groups_per_call}",
        ],
    )
    assert cfg.rollout_call_groups == expected
