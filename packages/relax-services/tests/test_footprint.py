"""The per-update split read from metrics.jsonl and the PSS of a process tree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from relax_services.footprint import PeakMemory, UpdateSplit, format_footprint, tree_pss, update_split


def _write(path: Path, records: list[dict[str, object]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"kind": "train", "torn', encoding="utf-8")


def test_update_split_is_the_median_of_each_part(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _write(
        path,
        [
            {"kind": "train", "train_s": 0.3, "weight_sync_s": 0.01, "wait_s": 2.0},
            {"kind": "rollout", "train_s": 99.0, "seconds": 1.0},  # not an update
            {"kind": "train", "train_s": 0.1, "weight_sync_s": 0.03, "wait_s": 0.5},
            {"kind": "train", "train_s": 0.2, "weight_sync_s": 0.02, "wait_s": 0.0},
        ],
    )
    split = update_split(path)
    assert split == UpdateSplit(updates=3, compute_s=0.2, publish_s=0.02, wait_s=0.5)
    text = format_footprint(split, 1_230_000_000)
    assert "compute 0.200s, publish 0.020s, wait 0.500s" in text
    assert "trainer busy 31%" in text  # 0.22 / 0.72
    assert "1.23 GB" in text


def test_update_split_without_updates(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _write(path, [{"kind": "eval", "version": 0}])
    assert update_split(path) is None
    assert "no update" in format_footprint(None, None)


def test_tree_pss_counts_children() -> None:
    pytest.importorskip("psutil")
    size = 200_000_000
    child = subprocess.Popen(
        [sys.executable, "-c", f"import sys; b = b'\\x01' * {size}; print('ok', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ok"  # allocated and touched
        alone = tree_pss(child.pid)
        assert alone >= size  # a bytearray's pages are private to the child: all of them count
        with PeakMemory(interval_s=0.05) as memory:
            pass
        assert memory.samples >= 2
        assert memory.peak_bytes >= alone  # this process's tree includes the child
    finally:
        child.communicate(b"")
    assert tree_pss(child.pid) == 0  # gone


def test_peak_memory_rejects_a_bad_interval() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        PeakMemory(interval_s=0)
