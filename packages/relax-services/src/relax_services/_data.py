"""The run's data: dataset files (the user's, or the synthetic omni tasks written as such files) read as one
endless training stream and a held-out set, and turned into model-ready prompts by relax-modalities' data paths."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from relax_modalities import (
    BadRowInfo,
    BadRowStats,
    DataFileSpec,
    DataRecord,
    MediaError,
    ProcessorSettings,
    SampleProcessor,
    build_stream,
)
from relax_modalities.synthetic import TaskItem
from relax_modalities.text import CheckpointTemplate
from relax_services._chance import ChanceLevels
from relax_services._dataset import DataReport, RecordStream, eval_stream, record_item, train_stream
from relax_services._synthetic import with_synthetic_files
from relax_services.config import ModelConfig, RunConfig
from relax_services.models import MODEL_MODALITIES, Checkpoint, OmniPrompt, check_placeholders, open_checkpoint
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
    """relax-modalities' settings for a checkpoint: its chat template and placeholder ids, and each registered
    modality's settings as its `ModelModality.processor_settings` reads them from the model config and
    ``preprocessor_config.json`` (for the built-in ones: the vision geometry and mel bins of the model config, the
    pixel budget, normalisation and audio framing of the preprocessor config, the processors' defaults where a key
    is absent)."""
    per_modality: dict[str, object] = {}
    for name, modality in MODEL_MODALITIES.items():
        own = modality.processor_settings(ckpt.config, ckpt.preprocessor_for(name))
        if own is not None:
            per_modality[name] = own
    template = CheckpointTemplate.of(ckpt.tokens.placeholders)
    return ProcessorSettings(template=template, modalities=per_modality)


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
