"""Pruning the warm-up cache: the most recently used entries stay (a hit counts as a use), each store prunes, and
pruning is safe with other runs reading or pruning at once."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from relax_services.control import warmup_cache
from relax_services.control.warmup_cache import INFO_FILE, KEEP_ENTRIES, prune_warmups, restore_warmup, store_warmup


def _entry(folder: Path, key: str, used_at: float) -> Path:
    """A complete cache entry (a checkpoint's config and weights, its info file) last used at ``used_at``."""
    entry = folder / key
    entry.mkdir(parents=True)
    (entry / "config.json").write_text("{}", encoding="utf-8")
    (entry / "model.safetensors").write_bytes(os.urandom(4096))
    (entry / INFO_FILE).write_text(json.dumps({"key": key}), encoding="utf-8")
    os.utime(entry / INFO_FILE, (used_at, used_at))
    return entry


def _cache(tmp_path: Path, n: int) -> tuple[Path, list[str]]:
    """``n`` entries k00 (least recently used, 1000 s ago) ... k<n-1> (the most recent)."""
    folder = tmp_path / "cache" / "warmup"
    base = time.time() - 1000.0
    keys = [f"k{i:02d}" for i in range(n)]
    for i, key in enumerate(keys):
        _entry(folder, key, base + i)
    return folder, keys


def _left(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def test_prune_keeps_the_most_recently_used(tmp_path: Path) -> None:
    folder, keys = _cache(tmp_path, 10)
    assert sorted(prune_warmups(folder, keep=8)) == ["k00", "k01"]
    assert _left(folder) == set(keys[2:])  # nothing else either: no folder renamed aside is left behind
    assert prune_warmups(folder, keep=8) == []


def test_the_default_keeps_eight() -> None:
    assert KEEP_ENTRIES == 8


def test_a_hit_marks_its_entry_used_and_a_store_prunes(tmp_path: Path) -> None:
    folder, keys = _cache(tmp_path, 9)
    out = tmp_path / "run" / "warmup_model"
    info = restore_warmup(folder / "k00", out)  # the least recently used entry is hit: now the most recent
    assert info == {"key": "k00"}
    assert (out / "model.safetensors").read_bytes() == (folder / "k00" / "model.safetensors").read_bytes()
    assert not (out / INFO_FILE).exists()
    result = tmp_path / "fresh"
    result.mkdir()
    (result / "config.json").write_text("{}", encoding="utf-8")
    store_warmup("new", result, {"key": "new"}, {}, cache=tmp_path / "cache")  # 10 entries: the 2 oldest go
    assert _left(folder) == {"new", "k00", *keys[3:]}


def test_store_prunes_to_the_given_number(tmp_path: Path) -> None:
    folder, _ = _cache(tmp_path, 3)
    result = tmp_path / "fresh"
    result.mkdir()
    (result / "config.json").write_text("{}", encoding="utf-8")
    store_warmup("new", result, {}, {}, cache=tmp_path / "cache", keep=2)
    assert _left(folder) == {"new", "k02"}


def test_what_killed_stores_left_is_removed_once_stale(tmp_path: Path) -> None:
    folder, _ = _cache(tmp_path, 1)
    stale, live = folder / ".k00.abc", folder / ".trash-k09-1-ff"
    for private in (stale, live):
        private.mkdir()
        (private / "config.json").write_text("{}", encoding="utf-8")
    two_days_ago = time.time() - 2 * 86400
    os.utime(stale, (two_days_ago, two_days_ago))
    prune_warmups(folder)
    assert _left(folder) == {"k00", live.name}  # a recent private folder may be another run's store in progress


def test_an_entry_pruned_while_it_is_copied_is_a_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another run prunes the entry after this run found it and while it copies it: this run runs the warm-up
    instead, and stores its result."""
    folder, _ = _cache(tmp_path, 0)
    inputs = {"probe": 1}
    key = warmup_cache.warmup_key(inputs)
    _entry(folder, key, time.time())
    (folder / key / "tokenizer.json").write_text("{}", encoding="utf-8")  # a second file to copy after the prune
    monkeypatch.setattr(warmup_cache, "warmup_inputs", lambda *_args: inputs)
    monkeypatch.setattr("relax_services.models.source_check.check_source", lambda *_args: tmp_path)  # the folder check
    real_copytree = shutil.copytree

    def copytree_racing_a_prune(src: Any, dst: Any, **kwargs: Any) -> Any:
        def copy(a: str, b: str) -> Any:
            prune_warmups(folder, keep=0)  # the other run, between two files of this copy
            return shutil.copy2(a, b)

        return real_copytree(src, dst, copy_function=copy, **kwargs)

    monkeypatch.setattr(warmup_cache.shutil, "copytree", copytree_racing_a_prune)
    out = tmp_path / "run" / "warmup_model"
    calls: list[int] = []

    def run() -> dict[str, object]:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text("{}", encoding="utf-8")
        calls.append(1)
        return {"steps": 3}

    cfg: Any = type("Cfg", (), {"model": type("Model", (), {"source": "x", "seed": 0})()})()
    with pytest.raises(FileNotFoundError, match="removed while it was copied"):
        restore_warmup(_entry(folder, "other", time.time()), tmp_path / "elsewhere")
    _entry(folder, key, time.time())
    (folder / key / "tokenizer.json").write_text("{}", encoding="utf-8")
    info = warmup_cache.load_or_run(cfg, [], out, run, cache=tmp_path / "cache")
    assert calls == [1] and info["cached"] is False
    monkeypatch.setattr(warmup_cache.shutil, "copytree", real_copytree)
    assert warmup_cache.cached_warmup(key, tmp_path / "cache") is not None  # the run's own result was stored


def test_two_runs_pruning_at_once_remove_each_entry_once(tmp_path: Path) -> None:
    folder, keys = _cache(tmp_path, 20)
    barrier = threading.Barrier(2)
    removed: list[list[str]] = [[], []]

    def prune(i: int) -> None:
        barrier.wait()
        removed[i] = prune_warmups(folder, keep=8)

    threads = [threading.Thread(target=prune, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert _left(folder) == set(keys[12:])
    assert set(removed[0]) | set(removed[1]) == set(keys[:12])


def test_a_negative_keep_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep must be >= 0, got -1"):
        prune_warmups(tmp_path, keep=-1)
