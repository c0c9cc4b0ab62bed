"""The default run's data: the synthetic omni tasks as dataset files in the row schema, one training file and one
held-out file per task, written once into a cache (as the default model is) and then read like any user file.

:func:`with_synthetic_files` turns a run config without ``data.train_files`` into one that names those files
(each task's training file weighted 1, the even task mix) and routes each task's ``data_source`` to its answer
check by registry name, so the default run takes exactly the path a user's data takes.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from relax_core import DataFileSpec, RewardSpec
from relax_services.config import DataConfig, RunConfig
from relax_services.models._light import cache_dir

__all__ = ["HELDOUT_SEED_OFFSET", "SYNTHETIC_REWARDS", "synthetic_task_file", "with_synthetic_files"]

HELDOUT_SEED_OFFSET = 1_000_003
"""The held-out files' seed is ``data.seed`` plus this: their items never coincide with the training items."""

SYNTHETIC_REWARDS: dict[str, str] = {
    "image": "exact_match",
    "audio": "exact_match",
    "video": "exact_match",
    "text": "exact_match",
    "audio_video": "exact_match",
}
"""Each synthetic task's answer check, by reward registry name (its ``data_source`` is routed to it)."""

_FORMAT = 1  # bump when the files' layout changes, so old cache folders are not reused


def _generator_version() -> str:
    """relax-modalities' installed version; from a source checkout (its ``src`` on ``PYTHONPATH``, no package
    metadata) a digest of its synthetic generators' source, so a changed generator still never reuses old files."""
    try:
        return version("relax-modalities")
    except PackageNotFoundError:
        import relax_modalities.synthetic as generators

        digest = hashlib.sha256()
        for file in sorted(Path(generators.__file__).parent.glob("*.py")):
            digest.update(file.read_bytes())
        return f"source-{digest.hexdigest()[:12]}"


def _folder(root: Path, task: str, n: int, seed: int, difficulty: int) -> Path:
    # The generator's package version is in the key: a changed generator never reuses old files.
    key = json.dumps(
        {
            "format": _FORMAT,
            "modalities": _generator_version(),
            "task": task,
            "n": n,
            "seed": seed,
            "difficulty": difficulty,
        },
        sort_keys=True,
    )
    return root / "synthetic" / f"{task}-n{n}-s{seed}-d{difficulty}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def synthetic_task_file(root: Path, task: str, n: int, seed: int, difficulty: int) -> Path:
    """``n`` items of ``task`` as a JSONL dataset file (with its media beside it) under ``root``, written on first
    use and reused after.

    Concurrent first uses are safe: each writer fills a private folder and renames it into place; the first
    rename wins and the others are discarded (the rows' media paths are relative, so the rename keeps them).
    """
    folder = _folder(root, task, n, seed, difficulty)
    path = folder / f"{task}.jsonl"
    if path.is_file():
        return path
    from relax_modalities.synthetic import write_task_file  # the media stack (torch): only to write the files

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        write_task_file(tmp, task, n, seed, difficulty, data_source=task)
        try:
            tmp.rename(folder)
        except OSError as exc:  # another process renamed its copy first
            if not path.is_file():
                raise RuntimeError(f"an incomplete synthetic data folder {folder} is in the way; remove it") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _write_missing_in_child(root: Path, wanted: Sequence[tuple[str, int, int]], difficulty: int) -> None:
    """Write the missing ones of ``wanted`` (task, n, seed) files in one child Python process when this process has
    not imported torch (the driver: writing the media loads the media stack, ≈ 0.6 GB it never frees)."""
    missing = [
        (t, n, seed) for t, n, seed in wanted if not (_folder(root, t, n, seed, difficulty) / f"{t}.jsonl").is_file()
    ]
    if not missing or "torch" in sys.modules:
        return  # nothing to write, or the stack is loaded already: synthetic_task_file writes in process
    args = json.dumps({"root": str(root), "wanted": missing, "difficulty": difficulty})
    out = subprocess.run(
        [sys.executable, "-m", "relax_services.data.synthetic", args], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(
            f"writing the synthetic task files under {root} failed in a child process:\n{out.stderr[-3000:]}"
        )


def _files(data: DataConfig) -> tuple[list[DataFileSpec], list[DataFileSpec]]:
    root = data.data_dir or cache_dir() / "datasets"
    heldout_seed = data.seed + HELDOUT_SEED_OFFSET
    _write_missing_in_child(
        root,
        [(t, data.train_per_task, data.seed) for t in data.tasks]
        + [(t, data.eval_per_task, heldout_seed) for t in data.tasks],
        data.difficulty,
    )
    train = [
        DataFileSpec(path=str(synthetic_task_file(root, t, data.train_per_task, data.seed, data.difficulty)), weight=1)
        for t in data.tasks
    ]
    heldout = [
        DataFileSpec(path=str(synthetic_task_file(root, t, data.eval_per_task, heldout_seed, data.difficulty)))
        for t in data.tasks
    ]
    return train, heldout


def with_synthetic_files(cfg: RunConfig) -> RunConfig:
    """``cfg`` itself when it names dataset files; else ``cfg`` with ``data.train_files`` / ``data.eval_files``
    the synthetic tasks' files (written first if missing) and each task's ``data_source`` routed to
    :data:`SYNTHETIC_REWARDS` (a route the config gives itself is kept)."""
    if cfg.data.train_files:
        return cfg
    train, heldout = _files(cfg.data)
    routes = {t: RewardSpec(fn=SYNTHETIC_REWARDS[t]) for t in cfg.data.tasks} | dict(cfg.reward.routes)
    return cfg.model_copy(
        update={
            "data": cfg.data.model_copy(update={"train_files": train, "eval_files": heldout}),
            "reward": cfg.reward.model_copy(update={"routes": routes}),
        }
    )


if __name__ == "__main__":  # _write_missing_in_child's child: writes the files in process
    job = json.loads(sys.argv[1])
    for task, n, seed in job["wanted"]:
        synthetic_task_file(Path(job["root"]), task, n, seed, job["difficulty"])
