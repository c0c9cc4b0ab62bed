"""Reading dataset files needs neither numpy nor torch: the package resolves its names on first use, so a process
that only streams records and reports bad rows (a run's prompt feeder) stays free of the media paths' stack.

Checked in a fresh interpreter with an import hook that refuses numpy and torch: before the package's names were
lazy, ``import relax_modalities`` imported the image path, and with it numpy and torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_SCRIPT = """
import importlib.abc, json, sys

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("numpy", "torch"):
            raise ImportError(f"blocked import of {name}")
        return None

sys.meta_path.insert(0, Blocker())
from relax_modalities import BadRowStats, DataFileSpec, DataRecord, MediaError, build_stream

stream = build_stream([DataFileSpec(path=sys.argv[1])], shuffle_buffer=0, seed=0, epochs=1)
records = list(stream)
assert all(isinstance(r, DataRecord) for r in records)
error = MediaError("a.png", "image", "truncated")
print(json.dumps({
    "answers": [r.ground_truth for r in records],
    "sources": [r.data_source for r in records],
    "bad": stream.stats.total,
    "error": str(error),
    "loaded": sorted(m for m in sys.modules if m.split(".")[0] in ("numpy", "torch")),
}))
"""


def test_dataset_records_stream_without_numpy_or_torch(tmp_path: Path) -> None:
    rows = [
        {"prompt": [{"role": "user", "content": "1+2="}], "data_source": "add", "reward_model": {"ground_truth": "3"}},
        {"prompt": [{"role": "user", "content": "2+2="}], "data_source": "add", "reward_model": {"ground_truth": "4"}},
        {"prompt": "not a chat", "data_source": "add"},  # no ground truth: skipped and counted
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["answers"] == ["3", "4"] and result["sources"] == ["add", "add"]
    assert result["bad"] == 1
    assert "a.png" in result["error"]
    assert result["loaded"] == []


def test_the_built_in_columns_are_the_ones_the_registry_declares() -> None:
    # What the dataset reader uses while the registry (and its media stack) is not loaded.
    from relax_modalities._modality import MODALITY_PATHS
    from relax_modalities._paths import AUDIO, IMAGE, VIDEO
    from relax_modalities._rows import BUILTIN_COLUMNS

    built_in = {p.name: p.column for p in (IMAGE, VIDEO, AUDIO)}
    assert built_in == BUILTIN_COLUMNS
    assert list(BUILTIN_COLUMNS) == [n for n in MODALITY_PATHS if n in built_in]  # registry order
