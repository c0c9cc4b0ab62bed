"""The samples files and the report without a run: a non-image file is copied once into the run folder and linked
relatively, a non-finite reward is null and flagged, and text that looks like HTML stays text in the report."""

from __future__ import annotations

import json
import re
from pathlib import Path

from relax_services.reporting.samples import read_samples, write_eval_samples
from relax_services.reporting.viewer import write_report


def test_media_copied_once_nonfinite_flagged_and_html_kept_as_text(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    clip = tmp_path / "clip.WAV"
    clip.write_bytes(b"RIFF-not-really-audio")
    tricky = 'a </script><img src=x onerror="alert(1)"> b'
    sample = {"task": "audio", "prompt": tricky, "response": "r", "reward": float("nan")}
    for version in (0, 2):  # the same held-out file in two evaluations
        write_eval_samples(run_dir, version, 3, [{**sample, "media": [{"kind": "audio", "path": str(clip)}]}])
    rows = list(read_samples(run_dir))
    assert [(r["version"], r["staleness"]) for r in rows] == [(0, 3), (2, 1)]
    assert rows[0]["reward"] is None and rows[0]["nonfinite"] == ["reward"]
    [copied] = list((run_dir / "samples" / "media").iterdir())
    assert copied.read_bytes() == clip.read_bytes() and copied.suffix == ".wav"
    assert rows[0]["media"] == [{"kind": "audio", "path": f"samples/media/{copied.name}", "copied": True}]

    page = write_report(run_dir).read_text(encoding="utf-8")
    assert "no summary.txt" in page and "no plots" in page
    data = re.search(r'<script type="application/json" id="samples-data">(.*?)</script>', page, re.S)
    assert data is not None and json.loads(data.group(1)) == rows  # the script element ends after the data only
