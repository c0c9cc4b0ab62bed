"""The run's data: dataset files (the user's, or the synthetic omni tasks written as such files) read as one
endless training stream and a held-out set, and turned into model-ready prompts by relax-modalities' data paths
(:class:`~relax_services._prompts.PromptBuilder`, which imports them where it first builds a prompt)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from relax_modalities import BadRowInfo, BadRowStats, DataFileSpec, MediaError, build_stream
from relax_services._chance import ChanceLevels
from relax_services._dataset import DataReport, RecordStream, eval_stream, record_item, train_stream
from relax_services._prompts import PromptBuilder, processor_settings
from relax_services._source_check import check_source
from relax_services._synthetic import with_synthetic_files
from relax_services.config import RunConfig
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

    The checkpoint is validated first (:func:`~relax_services._source_check.check_source`), so a bad
    ``model.source`` fails here, before any file is written or service started.
    """
    check_source(cfg.model.source, cfg.model.seed)
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
