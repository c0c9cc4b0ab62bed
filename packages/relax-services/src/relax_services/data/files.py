"""User dataset files as the run's data: an endless, resumable record stream the feeder draws from, the
held-out records grouped by ``data_source``, and the start-up check that fails on an unusable file or reward
before any service starts."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from relax_core import build_reward_runner
from relax_modalities import BadRowInfo, DataFileError, DataRecord, DataStream, build_stream, media_columns
from relax_services.config import DataConfig, RunConfig
from relax_services.rows import DataItem

__all__ = ["DATASET_TASK", "DataReport", "RecordStream", "check_data", "eval_stream", "record_item", "train_stream"]

DATASET_TASK = "dataset"
"""The feeder's one stream name for dataset files (the files' own mix is the stream's; tasks are data_sources)."""


def _answer_text(value: object) -> str:
    """The ground truth as text (the ``answer`` every item carries): strings as they are, anything else JSON."""
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


def record_item(record: DataRecord) -> DataItem:
    """A record as a feeder item. Its id is ``"<file>:<row>@<epoch>"``: the ledger names each pass over a row
    apart, so "every row once per epoch" is checkable from the ledger alone."""
    return {
        "id": f"{record.uid}@{record.epoch}",
        "task": record.data_source or DATASET_TASK,
        "answer": _answer_text(record.ground_truth),
        "data_source": record.data_source,
        "ground_truth": record.ground_truth,
        "extra_info": dict(record.extra_info),
        "item": record,
    }


@dataclass
class DataReport:
    """What the run says about its dataset files: rows skipped (file, row, reason) and held-out coverage."""

    train_files: list[str] = field(default_factory=list)
    eval_files: list[str] = field(default_factory=list)
    bad_rows: int = 0
    bad_rows_by_file: dict[str, int] = field(default_factory=dict)
    recent_bad_rows: list[tuple[str, int, str]] = field(default_factory=list)
    heldout_by_source: dict[str, int] = field(default_factory=dict)
    chance_unknown: dict[str, str] = field(default_factory=dict)  # data_source -> why its chance level is unknown

    def as_dict(self) -> dict[str, object]:
        """JSON-ready."""
        return {
            "train_files": list(self.train_files),
            "eval_files": list(self.eval_files),
            "bad_rows": self.bad_rows,
            "bad_rows_by_file": dict(self.bad_rows_by_file),
            "recent_bad_rows": [list(b) for b in self.recent_bad_rows],
            "heldout_by_source": dict(self.heldout_by_source),
            "chance_unknown": dict(self.chance_unknown),
        }


class RecordStream:
    """The feeder's stream over dataset files: an endless :class:`~relax_modalities.DataStream` yielding
    :func:`record_item` items; its position is the stream's ``state_dict`` plus the task weights below.

    Task weights (the feeder's adaptive mix) act per file: a file's weight is its configured weight times the
    mean weight of the ``data_source`` values its rows carried so far (``default`` for a file none of whose
    tasks has one yet), so a file of one task gets exactly that task's share.

    Args:
        stream: The endless record stream.
        cache_rows: The feeder may keep each row's processed prompt (by file and row, across passes) when the
            files hold at most this many rows in all; above it prompts are processed every time, so memory does
            not grow with the files.
    """

    def __init__(self, stream: DataStream, cache_rows: int = 4096) -> None:
        self.stream = stream
        self._cache = sum(len(s) for s in stream.sources) <= cache_rows
        self._base = list(stream.weights)
        self._index = {s.name: i for i, s in enumerate(stream.sources)}
        self.file_tasks: dict[str, list[str]] = {}  # file -> data_sources its rows carried so far
        self.task_weights: dict[str, float] = {}
        self.default_weight = 1.0

    def next(self) -> DataItem:
        """The next record's item.

        Raises:
            RuntimeError: every file's rows are bad (nothing left to train on).
        """
        try:
            record = next(self.stream)
        except StopIteration:
            files = [s.name for s in self.stream.sources]
            raise RuntimeError(
                f"data.train_files {files}: no readable row left ({self.stream.stats.total} bad)"
            ) from None
        item = record_item(record)
        tasks = self.file_tasks.setdefault(record.source, [])
        if item["task"] not in tasks:
            tasks.append(item["task"])
            self._apply()
        return item

    def cache_key(self, item: DataItem) -> str | None:
        """What the feeder may cache ``item``'s prompt under (its file and row), or None (not cached)."""
        record: DataRecord = item["item"]
        return record.uid if self._cache else None

    def set_task_weights(self, weights: Mapping[str, float], default: float) -> None:
        """Weigh each file by its tasks' ``weights`` (``default`` for a task not in them); see the class."""
        self.task_weights = dict(weights)
        self.default_weight = default
        self._apply()

    def _apply(self) -> None:
        if not self.task_weights:
            return
        factors = [self.default_weight] * len(self._base)
        for name, tasks in self.file_tasks.items():
            values = [self.task_weights.get(t, self.default_weight) for t in tasks]
            factors[self._index[name]] = sum(values) / len(values)
        self.stream.set_weights([b * f for b, f in zip(self._base, factors, strict=True)])

    def skip(self, item: DataItem, reason: str) -> None:
        """Count a row whose media could not be decoded as a bad row (on its first pass, as parse failures)."""
        record: DataRecord = item["item"]
        if record.epoch == 0:
            self.stream.stats.add(BadRowInfo(record.source, record.row, reason))

    def state_dict(self) -> dict[str, object]:
        """The stream's position and the task weights (plain JSON values)."""
        return {
            **self.stream.state_dict(),
            "file_tasks": {k: list(v) for k, v in self.file_tasks.items()},
            "task_weights": dict(self.task_weights),
            "default_weight": self.default_weight,
        }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Continue from :meth:`state_dict`."""
        self.stream.load_state_dict(state)
        tasks = state.get("file_tasks", {})
        weights = state.get("task_weights", {})
        assert isinstance(tasks, dict) and isinstance(weights, dict)
        self.file_tasks = {str(k): [str(t) for t in v] for k, v in tasks.items()}
        self.task_weights = {str(k): float(v) for k, v in weights.items()}
        default = state.get("default_weight", 1.0)
        assert isinstance(default, int | float)
        self.default_weight = float(default)
        self._apply()


def train_stream(cfg: DataConfig) -> RecordStream:
    """The endless training stream over ``cfg.train_files``."""
    stream = build_stream(cfg.train_files, cfg.schema_, shuffle_buffer=cfg.shuffle_buffer, seed=cfg.seed, epochs=None)
    return RecordStream(stream)


def eval_stream(cfg: DataConfig) -> DataStream:
    """One pass over ``cfg.eval_files`` in file order."""
    return build_stream(cfg.eval_files, cfg.schema_, shuffle_buffer=0, seed=cfg.seed, epochs=1)


def check_data(cfg: RunConfig) -> None:
    """Open every dataset file (existence, form and required columns) and load every reward function, so a bad
    ``data.train_files`` / ``data.eval_files`` / ``reward.fn`` fails at start-up, naming it.

    Raises:
        DataFileError: A dataset file is missing, unreadable or lacks a required column.
        ValueError: A reward function cannot be loaded, only some files are weighted, or ``data.schema`` names a
            media column for a modality that is not registered (or one column for two modalities).
    """
    try:  # the schema's media columns against the registered modalities (relax-modalities' MODALITY_PATHS)
        media_columns(cfg.data.schema_)
    except ValueError as exc:
        raise ValueError(f"data.{exc}") from None
    for name, files in (("data.train_files", cfg.data.train_files), ("data.eval_files", cfg.data.eval_files)):
        try:
            if files:
                build_stream(files, cfg.data.schema_, shuffle_buffer=0, epochs=1)
        except DataFileError as exc:
            raise DataFileError(exc.path, f"{exc.reason} ({name})") from None
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
    if cfg.data.eval_files and not cfg.data.train_files:
        raise ValueError("data.eval_files needs data.train_files (the synthetic tasks bring their own held-out set)")
    try:
        build_reward_runner(cfg.reward.runner_config()).close()
    except ValueError as exc:
        raise ValueError(f"reward: {exc}") from None
