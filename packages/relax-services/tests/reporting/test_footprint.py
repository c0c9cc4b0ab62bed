"""The per-update split read from metrics.jsonl and the PSS of a process tree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from relax_services.reporting.footprint import PeakMemory, UpdateSplit, format_footprint, tree_pss, update_split


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


def test_update_split_accounts_for_the_interval_between_updates(tmp_path: Path) -> None:
    # Three updates at t = 10.0, 10.5, 11.3: intervals 0.5 and 0.8. Update 2's parts sum to 0.1 + 0.05 + 0.2 +
    # 0.05 = 0.4 (0.1 outside them), update 3's to 0.2 + 0.05 + 0.3 + 0.05 = 0.6 (0.2 outside).
    path = tmp_path / "metrics.jsonl"
    _write(
        path,
        [
            {"kind": "train", "time": 10.0, "train_s": 9.0, "weight_sync_s": 0.05, "wait_s": 9.0, "queue_s": 0.01},
            {"kind": "train", "time": 10.5, "train_s": 0.1, "weight_sync_s": 0.05, "wait_s": 0.2, "queue_s": 0.05},
            {"kind": "train", "time": 11.3, "train_s": 0.2, "weight_sync_s": 0.05, "wait_s": 0.3, "queue_s": 0.05},
        ],
    )
    split = update_split(path)
    assert split is not None
    assert split.queue_s == pytest.approx(0.05)
    assert split.interval_s == pytest.approx(0.65)  # median of 0.5 and 0.8
    assert split.other_s == pytest.approx(0.15)  # median of 0.1 and 0.2
    text = format_footprint(split, None)
    assert "queue calls 0.050s; interval 0.650s, of it outside these 0.150s" in text


def test_publish_is_printed_against_a_plain_copy_of_its_bytes(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _write(
        path,
        [
            {"kind": "train", "train_s": 0.2, "weight_sync_s": 0.06, "wait_s": 0.0, "weight_sync_memcpy_s": 0.04},
            {"kind": "train", "train_s": 0.2, "weight_sync_s": 0.08, "wait_s": 0.0, "weight_sync_memcpy_s": 0.04},
            {"kind": "train", "train_s": 0.2, "weight_sync_s": 0.09, "wait_s": 0.0, "weight_sync_memcpy_s": 0.04},
        ],
    )
    split = update_split(path)
    assert split is not None and split.publish_memcpy_s == pytest.approx(0.04)
    assert "publish: 2.0x a plain memory copy of the same bytes (0.040s)" in format_footprint(split, None)


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


def test_peak_split_sums_to_the_peak_and_names_each_process() -> None:
    pytest.importorskip("psutil")
    size = 150_000_000
    script = f"import sys; b = b'\\x01' * {size}; print('ok', flush=True); sys.stdin.read()"
    command = [sys.executable, "-c", script]
    children = [subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE) for _ in range(2)]
    try:
        for child in children:
            assert child.stdout is not None and child.stdout.readline().strip() == b"ok"
        with PeakMemory(interval_s=0.05) as memory:
            pass
        split = memory.peak_processes
        assert sum(sum(sizes) for sizes in split.values()) == memory.peak_bytes  # the split of that one sample
        assert len(split["driver"]) == 1  # this process, the root
        others = sorted(size for label, sizes in split.items() if label != "driver" for size in sizes)
        assert len(others) >= 2 and all(s >= size for s in others[-2:])  # each child's touched bytes, at least
    finally:
        for child in children:
            child.communicate(b"")


@pytest.mark.parametrize(
    ("cmdline", "name", "label"),
    [
        (["ray::relax-3741ce77-reward-0:RewardService.__init__"], "ray::relax-3741", "RewardService"),
        (["ray::QueueActor"], "ray::QueueActor", "QueueActor"),
        (["ray::TrainerService.start"], "ray::TrainerSer", "TrainerService"),
        (["ray::IDLE"], "ray::IDLE", "IDLE"),
        (["/v/bin/python", "-u", "/v/site-packages/ray/dashboard/agent.py", "--port=1"], "python", "agent.py"),
        (["/v/site-packages/ray/core/src/ray/raylet/raylet", "--node=1"], "raylet", "raylet"),
        ([], "gcs_server", "gcs_server"),
    ],
)
def test_process_labels(cmdline: list[str], name: str, label: str) -> None:
    from relax_services.reporting.footprint import _label

    assert _label(cmdline, name) == label


def test_footprint_lists_the_peak_split_largest_first() -> None:
    text = format_footprint(None, 771_000_000, {"QueueActor": [95e6, 93e6], "TrainerService": [583e6]})
    assert text.splitlines()[-1] == "  at that peak, per process (MB PSS): TrainerService 583, QueueActor ×2 95+93"
