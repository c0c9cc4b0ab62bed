"""Which consumed rows the trainer trains on: DAPO's group filter."""

from __future__ import annotations

import torch

from relax_core import grpo_advantages
from relax_services.services import informative_rows


def _row(group: str, reward: float) -> dict:
    return {"meta": {"prompt_key": group}, "reward": reward}


def test_informative_rows_drops_exactly_the_uniformly_scored_groups() -> None:
    scored = [("a", 1.0), ("b", 0.0), ("a", 1.0), ("c", 0.0), ("b", 1.0), ("c", 0.0), ("d", 0.5), ("d", 0.5)]
    rows = [_row(group, reward) for group, reward in scored]
    kept = informative_rows(rows)
    assert [(r["meta"]["prompt_key"], r["reward"]) for r in kept] == [("b", 0.0), ("b", 1.0)]  # order kept
    # What is dropped carries no signal: its group-relative advantage is exactly zero.
    dropped = [r for r in rows if r not in kept]
    adv = grpo_advantages(torch.tensor([r["reward"] for r in dropped]), [r["meta"]["prompt_key"] for r in dropped])
    assert torch.equal(adv, torch.zeros(len(dropped)))
    assert informative_rows([_row("a", 0.0), _row("a", 0.0)]) == []
