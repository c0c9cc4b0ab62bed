"""The run's data: dataset files (the user's, or the synthetic omni tasks written as such files) read as one
endless training stream and a held-out set, and turned into model-ready prompts by relax-modalities' data paths
(:class:`~relax_services.data.prompts.PromptBuilder`, which imports them where it first builds a prompt)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from relax_core import RewardRunnerConfig
from relax_modalities import BadRowInfo, BadRowStats, DataFileSpec, build_stream
from relax_services.config import RunConfig
from relax_services.data.chance import ChanceLevels
from relax_services.data.files import DataReport, RecordStream, eval_stream, record_item, train_stream
from relax_services.data.prompts import HeldoutReport, HeldoutSet, PromptBuilder, processor_settings
from relax_services.data.synthetic import with_synthetic_files
from relax_services.models.source_check import check_source
from relax_services.rows import DataItem, HeldoutItem

__all__ = [
    "PromptBuilder",
    "RunData",
    "WarmupItem",
    "data_report",
    "finish_heldout",
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
    report. Tasks are the rows' ``data_source`` values.

    ``heldout`` is the held-out prompts, or (``prepare_data(..., build_heldout=False)``) the rows for the Evaluator
    to build; then ``chance``, ``skipped_heldout`` and the report's held-out counts are filled in by
    :func:`finish_heldout` from the Evaluator's :class:`~relax_services.data.prompts.HeldoutReport`.
    """

    stream: RecordStream
    heldout: list[HeldoutItem] | HeldoutSet
    chance: dict[str, float]
    skipped_heldout: dict[str, int]
    to_prompt: PromptBuilder
    report: DataReport
    train_files: list[DataFileSpec] = field(default_factory=list)
    rewards: RewardRunnerConfig | None = None
    """The reward routing the chance levels are computed under."""
    heldout_rows: list[DataItem] = field(default_factory=list)
    """The held-out rows as feeder items, in file order (what ``heldout`` is, or is built from)."""
    heldout_stats: BadRowStats | None = None
    """The held-out files' bad rows (those the stream skipped; rows with unreadable media join them)."""
    heldout_done: bool = False
    """Whether :func:`finish_heldout` has run (it runs once: a global restart's Evaluator reports again)."""


def prepare_data(cfg: RunConfig, run_dir: Path, *, build_heldout: bool = True) -> RunData:
    """The run's data from ``data.train_files`` / ``data.eval_files`` (without them: the synthetic tasks' files,
    written first if missing, :func:`~relax_services.data.synthetic.with_synthetic_files`): one endless training
    record stream, and the held-out records (tasks are their data_sources; no eval files: no held-out evaluation)
    rendered once, here, or with ``build_heldout=False`` left as rows for the Evaluator to render in its process
    (the driver then never imports the data paths' model stack; :func:`finish_heldout` takes its report).

    The checkpoint is validated first (:func:`~relax_services.models.source_check.check_source`), so a bad
    ``model.source`` fails here, before any file is written or service started.
    """
    check_source(cfg.model.source, cfg.model.seed)
    cfg = with_synthetic_files(cfg)
    to_prompt = PromptBuilder(cfg.model, inline_dir=run_dir / "data" / "inline")
    stream = train_stream(cfg.data)
    report = DataReport(
        train_files=[f.path for f in cfg.data.train_files], eval_files=[f.path for f in cfg.data.eval_files]
    )
    items: list[DataItem] = []
    stats: BadRowStats | None = None
    if cfg.data.eval_files:
        held = eval_stream(cfg.data)
        items = [record_item(record) for record in held]
        stats = held.stats
    rewards = cfg.reward.runner_config()
    pending = HeldoutSet(items, to_prompt)
    data = RunData(stream, pending, {}, {}, to_prompt, report, list(cfg.data.train_files), rewards, items, stats)
    if build_heldout:
        data.heldout, found = pending.build()
        finish_heldout(data, found)
    return data


def finish_heldout(data: RunData, found: HeldoutReport) -> None:
    """Complete ``data`` from the report of building its held-out prompts: the rows with unreadable media join the
    bad rows, and the kept rows give the chance levels and the per-source counts. Runs once (later calls, e.g. a
    restarted Evaluator's report, change nothing: the rows and their media are the same)."""
    if data.heldout_done:
        return
    data.heldout_done = True
    if data.heldout_stats is not None:
        for source, row, reason in found["bad"]:
            data.heldout_stats.add(BadRowInfo(source, row, reason))
        _add_bad(data.report, data.heldout_stats)
    if data.rewards is None:
        raise ValueError("finish_heldout: the run data has no reward routing (make it with prepare_data)")
    chance = ChanceLevels(data.rewards)
    for index in found["kept"]:
        item = data.heldout_rows[index]
        data.report.heldout_by_source[item["task"]] = data.report.heldout_by_source.get(item["task"], 0) + 1
        chance.add(item["task"], item["item"])
    data.report.chance_unknown = dict(chance.unknown)
    data.chance = dict(chance.levels())
    data.skipped_heldout = dict(found["skipped"])


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
