"""``metrics.jsonl`` is strict JSON: non-finite numbers are written as null and listed under ``nonfinite``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from relax_services.reporting.metrics import MetricsWriter, read_metrics


def _refuse(constant: str) -> float:
    raise ValueError(f"not strict JSON: {constant}")


def test_nonfinite_values_become_null_and_are_listed(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path / "metrics.jsonl")
    writer.write(
        "eval",
        {
            "version": 3,
            "reward": {"text": 0.5, "image": float("nan")},
            "chance": {"text": np.float32("inf"), "image": 0.25},
            "rewards": [1.0, -math.inf, np.float64(0.5)],
            "ok": True,
        },
    )
    writer.write("train", {"step": 1, "loss": 0.125})
    writer.close()
    first, second = (
        json.loads(line, parse_constant=_refuse) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    )
    assert first["reward"] == {"text": 0.5, "image": None}
    assert first["chance"] == {"text": None, "image": 0.25}
    assert first["rewards"] == [1.0, None, 0.5]
    assert first["ok"] is True
    assert first["nonfinite"] == ["reward.image", "chance.text", "rewards.1"]
    assert "nonfinite" not in second and second["loss"] == 0.125

    # read back, the flagged values are NaN again (a reader computing with them sees a missing measurement)
    (back,) = read_metrics(tmp_path / "metrics.jsonl", "eval")
    assert math.isnan(back["reward"]["image"]) and math.isnan(back["chance"]["text"]) and math.isnan(back["rewards"][1])
    assert back["reward"]["text"] == 0.5 and back["rewards"][2] == 0.5


def test_a_value_without_a_json_form_is_an_error(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path / "metrics.jsonl")
    with pytest.raises(TypeError, match="metrics value when of type object"):
        writer.write("x", {"when": object()})
    writer.close()
