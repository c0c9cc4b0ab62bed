"""Evaluation samples and ``relax view``: a short colocated run writes each evaluation's conversations to
``samples/eval_step_<version>.jsonl`` (strict JSON, at most ``eval.samples_per_task`` per task, image thumbnails),
and ``relax view`` turns the run folder into one static page whose task and step filters are checked in headless
Chromium (skipped when Chromium is not installed)."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from relax_services.cli import main
from relax_services.control.colocated import ColocatedController
from relax_services.reporting.metrics import read_metrics
from relax_services.reporting.summary import format_summary

KEEP = 3  # eval.samples_per_task, below data.eval_per_task = 8 of the fast config so the bound cuts
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _strict(text: str) -> object:
    def refuse(constant: str) -> object:
        raise ValueError(f"non-strict JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def viewed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object, dict[int, list[dict]]]:
    from relax_services.config import load_run_config

    from .conftest import FAST

    tmp = tmp_path_factory.mktemp("viewer")
    overrides = ["run.mode=colocated", "trainer.total_steps=2", "eval.every_steps=1", f"eval.samples_per_task={KEEP}"]
    cfg = load_run_config(
        None, [*FAST, f"run.output_dir={tmp}", "run.name=run", "data.tasks=[image, text]", *overrides]
    )
    run_dir = tmp / "run"
    run_dir.mkdir()
    result = ColocatedController(cfg, run_dir).run()
    (run_dir / "summary.txt").write_text(format_summary(result) + "\n", encoding="utf-8")
    files = sorted((run_dir / "samples").glob("eval_step_*.jsonl"))
    by_version = {int(f.stem.rpartition("_")[2]): [_strict(line) for line in f.read_text().splitlines()] for f in files}
    assert main(["view", str(run_dir)]) == 0
    return run_dir, result, by_version  # type: ignore[return-value]


@pytest.mark.integration
def test_every_evaluation_writes_bounded_strict_samples(viewed_run) -> None:
    run_dir, result, by_version = viewed_run
    evals = list(read_metrics(run_dir / "metrics.jsonl", "eval"))
    evaluated = {int(r["version"]) for r in evals}
    assert set(by_version) == evaluated and 0 in evaluated and result.final_version in evaluated
    assert not any("samples" in r for r in evals)  # the conversations live in their own files
    for version, rows in by_version.items():
        assert Counter(r["task"] for r in rows) == {"image": KEEP, "text": KEEP}
        for row in rows:
            assert row["version"] == version and row["staleness"] == row["step"] - version >= 0
            assert isinstance(row["prompt"], str) and row["prompt"] and isinstance(row["response"], str)
            assert row["reward"] is None or 0.0 <= row["reward"] <= 1.0
            assert row["final"] == (version == result.final_version)
        for row in rows:
            [media] = row["media"] if row["task"] == "image" else [None]
            if media is None:
                assert row["media"] == []
                continue
            assert media["kind"] == "image" and Path(media["path"]).is_file() and not media["copied"]
            header, _, payload = media["thumbnail"].partition(",")
            assert header == "data:image/png;base64"
            with Image.open(io.BytesIO(base64.b64decode(payload))) as thumb, Image.open(media["path"]) as source:
                (w, h), (sw, sh) = thumb.size, source.size
                assert thumb.format == "PNG"
            assert max(w, h) == min(96, max(sw, sh))
            # the thumbnail keeps the source's aspect ratio to within one pixel of rounding: |w/h - sw/sh| ≤ 1/h
            assert abs(w * sh - h * sw) <= sh
    # the same held-out prompts every evaluation: the first KEEP of each task
    prompts = {v: sorted((r["task"], r["prompt"]) for r in rows) for v, rows in by_version.items()}
    assert len({tuple(p) for p in prompts.values()}) == 1


@pytest.mark.integration
def test_report_embeds_the_plots_summary_and_samples(viewed_run) -> None:
    run_dir, _, by_version = viewed_run
    page = (run_dir / "report.html").read_text(encoding="utf-8")
    assert "http://" not in page and "https://" not in page  # nothing fetched from a network
    for name in ("reward.png", "queue_depth.png"):
        encoded = base64.b64encode((run_dir / name).read_bytes()).decode()
        assert f'alt="{name}" src="data:image/png;base64,{encoded}"' in page
    assert (run_dir / "summary.txt").read_text().splitlines()[0].split()[0] in page
    data = re.search(r'<script type="application/json" id="samples-data">(.*?)</script>', page, re.S)
    assert data is not None
    embedded = _strict(data.group(1))
    assert embedded == [row for v in sorted(by_version) for row in by_version[v]]


def _dom(report: Path, query: str) -> str:
    assert CHROMIUM is not None
    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", report.as_uri() + query]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120, check=True)
    return out.stdout


@pytest.mark.integration
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")
def test_report_filters_by_task_and_step_in_chromium(viewed_run) -> None:
    run_dir, _, by_version = viewed_run
    report = run_dir / "report.html"
    version = max(by_version)
    rows = re.compile(r'<tr class="sample" data-task="([^"]+)" data-step="(\d+)">')
    everything = Counter(rows.findall(_dom(report, "")))
    assert everything == Counter((r["task"], str(v)) for v, rs in by_version.items() for r in rs)
    dom = _dom(report, f"?task=image&step={version}")
    assert Counter(rows.findall(dom)) == {("image", str(version)): KEEP}
    assert f'<span id="shown">{KEEP}</span>' in dom
    text_rows = Counter(rows.findall(_dom(report, "?task=text")))
    assert text_rows == {("text", str(v)): KEEP for v in by_version}
