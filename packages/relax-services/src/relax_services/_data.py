"""The run's data: dataset files (the user's, or the synthetic omni tasks written as such files) read as one
endless training stream and a held-out set, and turned into model-ready prompts by relax-modalities' data paths."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from relax_modalities import (
    AudioSettings,
    BadRowInfo,
    BadRowStats,
    DataFileSpec,
    DataRecord,
    ImageSettings,
    MediaError,
    ProcessorSettings,
    SampleProcessor,
    VideoSettings,
    build_stream,
)
from relax_modalities.synthetic import TaskItem
from relax_modalities.text import CheckpointTemplate
from relax_services._chance import ChanceLevels
from relax_services._dataset import DataReport, RecordStream, eval_stream, record_item, train_stream
from relax_services._synthetic import with_synthetic_files
from relax_services.config import ModelConfig, RunConfig
from relax_services.models import Checkpoint, OmniPrompt, check_placeholders, open_checkpoint
from relax_services.rows import DataItem, HeldoutItem, ItemInfo

__all__ = [
    "PromptBuilder",
    "RunData",
    "WarmupItem",
    "data_report",
    "prepare_data",
    "processor_settings",
    "warmup_items",
]

WarmupItem = tuple[DataItem, tuple[str, ...]]
"""A training row for the format warm-up: its feeder item and its valid answers (``extra_info.options``)."""

_WARMUP_ROWS = 4096  # most training rows the warm-up draws from (read from the start of the files)


def processor_settings(ckpt: Checkpoint) -> ProcessorSettings:
    """relax-modalities' settings for a checkpoint: its chat template and placeholder ids, the vision geometry and
    mel bins of its model config, and the pixel budget, normalisation and audio framing of its
    ``preprocessor_config.json`` (the processors' defaults where a key is absent). The pixel budget is read as
    transformers' Qwen-VL image processors read it: ``min_pixels`` / ``max_pixels`` where given, else ``size``'s
    ``shortest_edge`` / ``longest_edge`` (the key Qwen3-VL's processors ship)."""
    pre, config = ckpt.preprocessor, ckpt.config
    size: dict[str, Any] = pre["size"] if isinstance(pre.get("size"), dict) else {}
    vision = getattr(config, "vision_config", None)
    audio = getattr(config, "audio_config", None)
    image = ImageSettings()
    image = replace(
        image,
        patch_size=int(getattr(vision, "patch_size", pre.get("patch_size", image.patch_size))),
        merge_size=int(getattr(vision, "spatial_merge_size", pre.get("merge_size", image.merge_size))),
        temporal_patch_size=int(getattr(vision, "temporal_patch_size", image.temporal_patch_size)),
        min_pixels=int(pre.get("min_pixels", size.get("shortest_edge", image.min_pixels))),
        max_pixels=int(pre.get("max_pixels", size.get("longest_edge", image.max_pixels))),
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
    """The training stream, the held-out set, each task's chance level, the prompt builder, and the files'
    report. Tasks are the rows' ``data_source`` values."""

    stream: RecordStream
    heldout: list[HeldoutItem]
    chance: dict[str, float]
    skipped_heldout: dict[str, int]
    to_prompt: PromptBuilder
    report: DataReport
    train_files: list[DataFileSpec] = field(default_factory=list)


def prepare_data(cfg: RunConfig, run_dir: Path) -> RunData:
    """The run's data from ``data.train_files`` / ``data.eval_files`` (without them: the synthetic tasks' files,
    written first if missing, :func:`~relax_services._synthetic.with_synthetic_files`): one endless training
    record stream, and the held-out records rendered once (tasks are their data_sources; no eval files: no
    held-out evaluation).

    The checkpoint is validated first (:func:`~relax_services.models.validate_checkpoint`), so a bad
    ``model.source`` fails here, before any file is written or service started.
    """
    open_checkpoint(cfg.model.source, cfg.model.seed)
    cfg = with_synthetic_files(cfg)
    to_prompt = PromptBuilder(cfg.model, inline_dir=run_dir / "data" / "inline")
    stream = train_stream(cfg.data)
    report = DataReport(
        train_files=[f.path for f in cfg.data.train_files], eval_files=[f.path for f in cfg.data.eval_files]
    )
    heldout: list[HeldoutItem] = []
    skipped: dict[str, int] = {}
    chance = ChanceLevels(cfg.reward.runner_config())
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
            chance.add(item["task"], record)
        _add_bad(report, held.stats)
    report.chance_unknown = dict(chance.unknown)
    return RunData(stream, heldout, dict(chance.levels()), skipped, to_prompt, report, list(cfg.data.train_files))


def warmup_items(cfg: RunConfig) -> list[WarmupItem]:
    """Training rows that list their valid answers (``extra_info.options``, as the synthetic tasks' rows do),
    from the first rows of the training files (at most 4096, one pass in file order): what the format warm-up
    trains on. Empty when the rows list none (then there is no warm-up)."""
    cfg = with_synthetic_files(cfg)
    stream = build_stream(cfg.data.train_files, cfg.data.schema_, shuffle_buffer=0, seed=cfg.data.seed, epochs=1)
    items: list[WarmupItem] = []
    for record, _ in zip(stream, range(_WARMUP_ROWS), strict=False):
        options = record.extra_info.get("options")
        if isinstance(options, list) and options and all(isinstance(o, str) for o in options):
            items.append((record_item(record), tuple(options)))
    return items


def _add_bad(report: DataReport, stats: BadRowStats) -> None:
    report.bad_rows += stats.total
    for source, n in stats.by_source.items():
        report.bad_rows_by_file[source] = report.bad_rows_by_file.get(source, 0) + n
    report.recent_bad_rows += [(b.source, b.row, b.reason) for b in stats.recent]


def data_report(data: RunData) -> dict[str, object]:
    """The dataset files' report at the end of a run (training bad rows as the stream counted them)."""
    report = DataReport(**{**data.report.__dict__, "bad_rows_by_file": dict(data.report.bad_rows_by_file)})
    report.recent_bad_rows = list(data.report.recent_bad_rows)
    _add_bad(report, data.stream.stream.stats)
    return report.as_dict()
