"""The synthetic omni tasks as a dataset file in the row schema, so they take the path user data takes."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relax_modalities._modality import MODALITY_PATHS
from relax_modalities.synthetic._manifest import TaskItem, iter_manifest
from relax_modalities.synthetic._tasks import TASKS, write_synthetic_tasks

__all__ = ["task_item_row", "write_synthetic_dataset", "write_task_file"]

_SYNTHETIC_MODALITIES = ("image", "video", "audio")  # what the synthetic tasks' items hold


def task_item_row(item: TaskItem, root: Path, data_source: str | None = None) -> dict[str, Any]:
    """One item as a verl-schema row: media before the text as markers, paths relative to ``root``.

    ``data_source`` is ``synthetic/<task>`` unless given; ``extra_info`` keeps the id, task, options (every valid
    answer: a uniform guess over them scores the chance level), chance and difficulty. A video with a sound
    track is ``{"video": path, "audio_track": true}``.
    """
    row: dict[str, Any] = {
        "data_source": f"synthetic/{item.task}" if data_source is None else data_source,
        "prompt": [{"role": "user", "content": "".join(f"<{m.modality}>" for m in item.media) + item.prompt}],
        **{MODALITY_PATHS[name].column: [] for name in _SYNTHETIC_MODALITIES},  # the paths' default columns
        "reward_model": {"style": "rule", "ground_truth": item.answer},
        "extra_info": {
            "id": item.id,
            "task": item.task,
            "options": list(item.options),
            "chance": item.chance,
            "difficulty": item.difficulty,
        },
    }
    for media in item.media:
        path = os.path.relpath(media.path, root)
        row[MODALITY_PATHS[media.modality].column].append(
            {"video": path, "audio_track": True} if media.audio_track else path
        )
    return row


def write_synthetic_dataset(
    out_dir: str | os.PathLike[str],
    tasks: Sequence[str] = TASKS,
    n_per_task: int = 64,
    seed: int = 0,
    difficulty: int = 0,
    *,
    name: str = "synthetic.jsonl",
) -> Path:
    """Write the synthetic tasks (as :func:`write_synthetic_tasks` does) and ``out_dir/name`` in the row schema.

    Returns:
        The JSONL file; ``build_stream([path])`` reads it like any user file.
    """
    manifest = write_synthetic_tasks(out_dir, tasks, n_per_task, seed, difficulty)
    path = Path(out_dir) / name
    with path.open("w") as f:
        for item in iter_manifest(manifest):
            f.write(json.dumps(task_item_row(item, path.parent), separators=(",", ":")) + "\n")
    return path


def write_task_file(
    out_dir: str | os.PathLike[str],
    task: str,
    n: int,
    seed: int = 0,
    difficulty: int = 0,
    *,
    data_source: str | None = None,
) -> Path:
    """Write ``n`` items of one task (media and manifest as :func:`write_synthetic_tasks` writes them) and
    ``out_dir/<task>.jsonl`` in the row schema. An item depends on ``(seed, task, index)`` only, so a task's file
    holds the very items a mix of several tasks written with the same arguments holds.

    Returns:
        The JSONL file (its media paths relative to it: the folder may be moved or renamed as a whole).
    """
    manifest = write_synthetic_tasks(out_dir, [task], n, seed, difficulty)
    path = Path(out_dir) / f"{task}.jsonl"
    with path.open("w") as f:
        for item in iter_manifest(manifest):
            f.write(json.dumps(task_item_row(item, path.parent, data_source), separators=(",", ":")) + "\n")
    return path
