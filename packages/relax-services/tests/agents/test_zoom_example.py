"""The zoom example (``examples/zoom``): its rows, its environment (the crop the first turn names, the answer only
visible there) and its run config, which loads with the environment's image declared."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from relax_core import import_file
from relax_services.agents import load_environment
from relax_services.config import load_run_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "zoom"
RGB = {"1": (220, 40, 40), "2": (40, 190, 60), "3": (40, 70, 220), "4": (230, 220, 40)}


@pytest.fixture(scope="module")
def rows() -> list[dict[str, object]]:
    prepare = import_file(EXAMPLE / "prepare.py", "relax_test_zoom", "examples/zoom/prepare.py")
    rows: list[dict[str, object]] = json.loads(json.dumps(prepare.rows(16, seed=0)))  # as the JSONL file holds them
    return rows


def test_the_answer_is_the_named_regions_colour_and_only_its_crop_shows_it(rows) -> None:  # type: ignore[no-untyped-def]
    env_spec = load_environment(f"{EXAMPLE / 'zoom_env.py'}:Zoom")
    assert env_spec.modalities == ("image",) and env_spec.has_step and env_spec.has_reward
    for row in rows:
        info = row["extra_info"]
        assert isinstance(info, dict) and row["answer"] in ("1", "2", "3", "4") and 1 <= info["region"] <= 4
        assert row["prompt"] == f"zoom {info['region']}"
        env = env_spec.new()
        [first] = env.reset({"answer": row["answer"], "extra_info": info})  # type: ignore[attr-defined]
        assert first["content"] == row["prompt"]  # text only: no picture before the zoom
        other = str(info["region"] % 4 + 1)  # another region's crop is grey: the colour is only in the named one
        grey = np.asarray(Image.open(io.BytesIO(env.crop(other))), dtype=np.float64)  # type: ignore[attr-defined]
        assert np.abs(grey.reshape(-1, 3).mean(0) - 128).max() < 3
        messages, reward, done = env.step({"role": "assistant", "content": str(info["region"])})  # type: ignore[attr-defined]
        assert (reward, done) == (None, False)
        [image] = [p for p in messages[0]["content"] if p["type"] == "image"]
        crop = np.asarray(Image.open(io.BytesIO(image["image"])), dtype=np.float64)  # [56, 56, 3]
        assert crop.shape == (56, 56, 3)
        # Within the ±12 pixel noise of the answer's colour, and farther than that from every other colour.
        mean = crop.reshape(-1, 3).mean(0)
        assert np.abs(mean - RGB[str(row["answer"])]).max() < 3
        assert env.step({"role": "assistant", "content": str(row["answer"])}) == ([], None, True)  # type: ignore[attr-defined]
        assert env.reward() == 1.0  # type: ignore[attr-defined]


def test_the_run_config_loads() -> None:
    cfg = load_run_config(EXAMPLE / "zoom.yaml", [])
    assert cfg.rollout.env is not None and cfg.rollout.env.endswith("zoom_env.py:Zoom")
    assert (cfg.rollout.max_turns, cfg.rollout.max_new_tokens) == (2, 2)
