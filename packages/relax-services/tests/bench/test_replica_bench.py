"""``relax bench replicas``' figures from a run folder's records, on a synthetic ``metrics.jsonl`` whose every
figure is derived by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from relax_services.bench.replicas import format_replica_table, live_scaling_figures


def _train(wall: float, wait: float, train: float, by: dict[str, int]) -> dict[str, object]:
    return {"kind": "train", "wall": wall, "step": int(wall * 2), "samples": 16, "wait_s": wait, "train_s": train,
            "samples_by_replica": by}  # fmt: skip


def test_live_scaling_figures_are_the_hand_derived_ones(tmp_path: Path) -> None:
    zero, both = {"rollout-0": 16}, {"rollout-0": 8, "rollout-1": 8}
    lines = [
        *(_train(w, 1.0, 1.0, zero) for w in (1.0, 2.0, 3.0)),
        {"kind": "scale", "wall": 3.5, "event": "requested"},
        *(_train(w, 2.0, 1.0, zero) for w in (4.0, 5.0)),
        {"kind": "scale", "wall": 5.5, "event": "joined"},
        _train(6.0, 0.5, 1.0, zero),
        *(_train(w, 0.5, 1.0, both) for w in (6.5, 7.0)),
        {"kind": "scale", "wall": 8.5, "event": "requested"},
        {"kind": "scale", "wall": 8.7, "event": "removed", "seconds": 0.2},
        *(_train(w, 1.0, 1.0, zero) for w in (9.0, 10.0)),
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    got = live_scaling_figures(tmp_path)
    expected = {
        "join_s": 5.5 - 3.5,
        "first_sample_s": 6.5 - 3.5,  # the first update that consumed a rollout-1 sample
        "drain_s": 0.2,
        "before_samples_per_s": 32 / 2.0,  # updates at 2 and 3 s after the one at 1 s
        "before_idle": 3.0 / 6.0,
        "joining_samples_per_s": 16 / 1.0,
        "joining_idle": 4.0 / 6.0,
        "after_samples_per_s": 32 / 1.0,  # 6.5 and 7 after 6
        "after_idle": 1.5 / 4.5,
        "after_in_samples_per_s": 16 / 1.0,
        "after_in_idle": 2.0 / 4.0,
    }
    assert got == pytest.approx(expected, rel=1e-12)
    # A run without a scale-in: its phases are NaN, the rest as before.
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines[:9]))
    partial = live_scaling_figures(tmp_path)
    assert math.isnan(partial["drain_s"]) and math.isnan(partial["after_in_samples_per_s"])
    assert partial["join_s"] == 2.0


def test_the_table_puts_counts_side_by_side() -> None:
    rows = [
        {"replicas": 1, "steps": 40, "samples_per_s": 100.0, "idle": 0.85, "blocked": 0.15, "split": {"rollout-0": 8}},
        {"replicas": 2, "steps": 40, "samples_per_s": 150.0, "idle": 0.5, "blocked": 0.2, "split": {"rollout-0": 4}},
    ]
    table = format_replica_table(rows).splitlines()  # type: ignore[arg-type]
    assert table[1].split() == ["1", "40", "100.0", "1.00×", "0.85", "0.15", "rollout-0:8"]
    assert table[2].split()[:4] == ["2", "40", "150.0", "1.50×"]
