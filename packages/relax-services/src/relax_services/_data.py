"""The run's data: synthetic omni tasks written as real files, split into training streams and a held-out set,
and turned into model-ready prompts by relax-modalities' data paths."""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_modalities import MediaError, SampleProcessor
from relax_modalities.synthetic import TaskItem, read_manifest, write_synthetic_tasks
from relax_modalities.text import TinyTokenizer
from relax_services.config import RunConfig
from relax_services.feeder import TaskStream
from relax_services.models import OmniPrompt

__all__ = ["RunData", "prepare_data", "to_prompt"]

_HELDOUT_SEED_OFFSET = 1_000_003


@dataclass
class RunData:
    """Training streams per task, the held-out set, and each task's chance level."""

    streams: dict[str, TaskStream]
    heldout: list[tuple[str, OmniPrompt, str]]
    chance: dict[str, float]
    skipped_heldout: dict[str, int]


@functools.cache
def _processor() -> SampleProcessor:
    return SampleProcessor(TinyTokenizer())


def to_prompt(item: Any) -> OmniPrompt:
    """A task item (or its feeder entry) to the thinker's inputs, through relax-modalities' data paths."""
    task_item: TaskItem = item["item"] if isinstance(item, dict) else item
    kwargs = _processor()(task_item)
    kwargs.pop("attention_mask")
    kwargs["input_ids"] = kwargs["input_ids"][0]  # [T]
    return OmniPrompt(**kwargs)


def _as_entry(item: TaskItem) -> dict[str, Any]:
    return {"id": item.id, "task": item.task, "answer": item.answer, "item": item}


def prepare_data(cfg: RunConfig, run_dir: Path) -> RunData:
    """Write (or reuse) the synthetic task files and build the training streams and held-out prompts."""
    root = cfg.data.data_dir or run_dir / "data"
    tasks: list[str] = list(cfg.data.tasks)
    # A user's data folder is read, never written: without a train split it is an error, without a held-out
    # split the run has no held-out evaluation. Only the run folder's own data/ is filled with synthetic tasks.
    users = cfg.data.data_dir is not None
    if users and not (root / "train" / "manifest.jsonl").is_file():
        raise ValueError(f"data.data_dir: {root} has no train/manifest.jsonl")
    train = _manifest(root / "train", tasks, cfg.data.train_per_task, cfg.data.seed, cfg.data.difficulty)
    heldout_items = (
        []
        if users and not (root / "heldout" / "manifest.jsonl").is_file()
        else _manifest(
            root / "heldout", tasks, cfg.data.eval_per_task, cfg.data.seed + _HELDOUT_SEED_OFFSET, cfg.data.difficulty
        )
    )
    by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for item in train:
        by_task[item.task].append(_as_entry(item))
    streams = {task: TaskStream(items, seed=cfg.data.seed) for task, items in by_task.items()}
    heldout = []
    skipped: dict[str, int] = {}
    for item in heldout_items:
        try:
            heldout.append((item.task, to_prompt(item), item.answer))
        except MediaError as exc:  # a bad held-out file is skipped and counted, like a bad training file
            skipped[exc.modality] = skipped.get(exc.modality, 0) + 1
    chance = {item.task: item.chance for item in heldout_items}
    return RunData(streams, heldout, chance, skipped)


def _manifest(folder: Path, tasks: list[str], n: int, seed: int, difficulty: int) -> list[TaskItem]:
    """The items of ``folder``'s manifest; written first unless a manifest is already there (then reused)."""
    manifest = folder / "manifest.jsonl"
    if not manifest.is_file():
        manifest = write_synthetic_tasks(folder, tasks, n, seed, difficulty)
    items = [item for item in read_manifest(manifest) if item.task in tasks]
    missing = sorted(set(tasks) - {item.task for item in items})
    if missing:
        raise ValueError(f"data: the manifest {manifest} has no items of task(s) {missing}")
    return items
