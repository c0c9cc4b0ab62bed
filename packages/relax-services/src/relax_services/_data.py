"""The run's data: synthetic omni tasks written as real files, split into training streams and a held-out set,
and turned into model-ready prompts by relax-modalities' data paths."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from relax_modalities import (
    AudioSettings,
    BadRowInfo,
    BadRowStats,
    DataRecord,
    ImageSettings,
    MediaError,
    ProcessorSettings,
    SampleProcessor,
    VideoSettings,
)
from relax_modalities.synthetic import TaskItem, read_manifest, write_synthetic_tasks
from relax_modalities.text import CheckpointTemplate
from relax_services._dataset import (
    DATASET_TASK,
    DataReport,
    RecordStream,
    eval_stream,
    record_item,
    train_stream,
)
from relax_services.config import ModelConfig, RunConfig
from relax_services.feeder import TaskStream
from relax_services.models import Checkpoint, OmniPrompt, check_placeholders, open_checkpoint
from relax_services.rows import DataItem, HeldoutItem, ItemInfo

__all__ = ["PromptBuilder", "RunData", "data_report", "prepare_data", "processor_settings"]

_HELDOUT_SEED_OFFSET = 1_000_003


def processor_settings(ckpt: Checkpoint) -> ProcessorSettings:
    """relax-modalities' settings for a checkpoint: its chat template and placeholder ids, the vision geometry and
    mel bins of its model config, and the pixel budget, normalisation and audio framing of its
    ``preprocessor_config.json`` (the processors' defaults where a key is absent)."""
    pre, config = ckpt.preprocessor, ckpt.config
    vision = getattr(config, "vision_config", None)
    audio = getattr(config, "audio_config", None)
    image = ImageSettings()
    image = replace(
        image,
        patch_size=int(getattr(vision, "patch_size", pre.get("patch_size", image.patch_size))),
        merge_size=int(getattr(vision, "spatial_merge_size", pre.get("merge_size", image.merge_size))),
        temporal_patch_size=int(getattr(vision, "temporal_patch_size", image.temporal_patch_size)),
        min_pixels=int(pre.get("min_pixels", image.min_pixels)),
        max_pixels=int(pre.get("max_pixels", image.max_pixels)),
        image_mean=tuple(pre.get("image_mean", image.image_mean)),
        image_std=tuple(pre.get("image_std", image.image_std)),
    )
    sound = AudioSettings()
    sound = replace(
        sound,
        sampling_rate=int(pre.get("sampling_rate", sound.sampling_rate)),
        n_fft=int(pre.get("n_fft", sound.n_fft)),
        hop_length=int(pre.get("hop_length", sound.hop_length)),
        num_mel_bins=int(getattr(audio, "num_mel_bins", pre.get("feature_size", sound.num_mel_bins))),
    )
    template = CheckpointTemplate.of(ckpt.tokens.placeholders)
    return ProcessorSettings(image=image, audio=sound, video=VideoSettings(vision=image), template=template)


@dataclass
class PromptBuilder:
    """Task item (or its feeder entry) → the model's inputs, through relax-modalities' data paths with the
    checkpoint's tokenizer, chat template and processor settings. Pickles as its model config only (each process
    reads the checkpoint folder once)."""

    model: ModelConfig
    inline_dir: Path | None = None
    """Where a dataset record's inline media bytes are written as files before decoding."""
    _processor: SampleProcessor | None = field(default=None, repr=False, compare=False)
    _ckpt: Checkpoint | None = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict[str, object]:
        return {"model": self.model, "inline_dir": self.inline_dir, "_processor": None, "_ckpt": None}

    def _ready(self) -> tuple[SampleProcessor, Checkpoint]:
        # Once per process: resolving the default source digests its config and checks its files on every call.
        if self._processor is None or self._ckpt is None:
            self._ckpt = open_checkpoint(self.model.source, self.model.seed)
            self._processor = SampleProcessor(self._ckpt.tokenizer, processor_settings(self._ckpt))
        return self._processor, self._ckpt

    def __call__(self, item: DataItem | TaskItem) -> OmniPrompt:
        processor, ckpt = self._ready()
        task_item: TaskItem | DataRecord = item["item"] if isinstance(item, dict) else item
        if isinstance(task_item, DataRecord):
            try:
                kwargs = processor.process_record(task_item, self.inline_dir)
            except ValueError as exc:  # a chat the template cannot render is this row's fault, like bad media
                if isinstance(exc, MediaError):
                    raise
                raise MediaError(task_item.uid, "manifest", f"chat template: {exc}") from exc
        else:
            kwargs = processor(task_item)
        kwargs.pop("attention_mask")
        kwargs["input_ids"] = kwargs["input_ids"][0]  # [T]
        return check_placeholders(OmniPrompt(**kwargs), ckpt.tokens)


@dataclass
class RunData:
    """Training streams per task, the held-out set, each task's chance level, and the prompt builder; for
    dataset files (``data.train_files``) one record stream and the files' report."""

    streams: dict[str, TaskStream | RecordStream]
    heldout: list[HeldoutItem]
    chance: dict[str, float]
    skipped_heldout: dict[str, int]
    to_prompt: PromptBuilder
    report: DataReport | None = None


def _as_entry(item: TaskItem) -> DataItem:
    return {"id": item.id, "task": item.task, "answer": item.answer, "item": item}


def prepare_data(cfg: RunConfig, run_dir: Path) -> RunData:
    """Write (or reuse) the synthetic task files and build the training streams and held-out prompts.

    The checkpoint is validated first (:func:`~relax_services.models.validate_checkpoint`), so a bad
    ``model.source`` fails here, before any service starts.
    """
    open_checkpoint(cfg.model.source, cfg.model.seed)  # validated before any file is written or service started
    if cfg.data.train_files:
        return _prepare_files(cfg, run_dir)
    to_prompt = PromptBuilder(cfg.model)
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
    by_task: dict[str, list[DataItem]] = defaultdict(list)
    for item in train:
        by_task[item.task].append(_as_entry(item))
    streams: dict[str, TaskStream | RecordStream] = {
        task: TaskStream(items, seed=cfg.data.seed) for task, items in by_task.items()
    }
    heldout: list[HeldoutItem] = []
    skipped: dict[str, int] = {}
    for item in heldout_items:
        try:
            heldout.append((item.task, to_prompt(item), {"id": item.id, "task": item.task, "answer": item.answer}))
        except MediaError as exc:  # a bad held-out file is skipped and counted, like a bad training file
            skipped[exc.modality] = skipped.get(exc.modality, 0) + 1
    chance = {item.task: item.chance for item in heldout_items}
    return RunData(streams, heldout, chance, skipped, to_prompt)


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


def _prepare_files(cfg: RunConfig, run_dir: Path) -> RunData:
    """The run's data from ``data.train_files`` / ``data.eval_files``: one endless record stream, and the
    held-out records rendered once (tasks are their data_sources; none given: no held-out evaluation)."""
    to_prompt = PromptBuilder(cfg.model, inline_dir=run_dir / "data" / "inline")
    stream = train_stream(cfg.data)
    report = DataReport(
        train_files=[f.path for f in cfg.data.train_files], eval_files=[f.path for f in cfg.data.eval_files]
    )
    heldout: list[HeldoutItem] = []
    skipped: dict[str, int] = {}
    if cfg.data.eval_files:
        held = eval_stream(cfg.data)
        for record in held:
            item = record_item(record)
            try:
                prompt = to_prompt(item)
            except MediaError as exc:
                skipped[exc.modality] = skipped.get(exc.modality, 0) + 1
                held.stats.add(BadRowInfo(record.source, record.row, f"{exc.modality}: {exc.reason}"))
                continue
            info: ItemInfo = {k: v for k, v in item.items() if k != "item"}  # type: ignore[assignment]
            heldout.append((item["task"], prompt, info))
            report.heldout_by_source[item["task"]] = report.heldout_by_source.get(item["task"], 0) + 1
        _add_bad(report, held.stats)
    chance = dict.fromkeys(report.heldout_by_source, math.nan)  # a dataset's chance level is not known
    return RunData({DATASET_TASK: stream}, heldout, chance, skipped, to_prompt, report)


def _add_bad(report: DataReport, stats: BadRowStats) -> None:
    report.bad_rows += stats.total
    for source, n in stats.by_source.items():
        report.bad_rows_by_file[source] = report.bad_rows_by_file.get(source, 0) + n
    report.recent_bad_rows += [(b.source, b.row, b.reason) for b in stats.recent]


def data_report(data: RunData) -> dict[str, Any] | None:
    """The dataset files' report at the end of a run (training bad rows as the stream counted them); None for
    the synthetic tasks."""
    if data.report is None:
        return None
    report = DataReport(**{**data.report.__dict__, "bad_rows_by_file": dict(data.report.bad_rows_by_file)})
    report.recent_bad_rows = list(data.report.recent_bad_rows)
    for stream in data.streams.values():
        if isinstance(stream, RecordStream):
            _add_bad(report, stream.stream.stats)
    return report.as_dict()
