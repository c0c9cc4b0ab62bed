"""The GPU check's report (``gpu_check.json``, :class:`Report`): its schema, the figures of one ``relax train`` run
read from its ``metrics.jsonl`` (:func:`summarize_records`), and the summary printed on the terminal.

Records read (see :mod:`relax_services.reporting.metrics`): ``train`` (the Trainer, one per update: ``step``,
``time``, ``wall``, ``samples``, ``tokens``, ``weight_sync_s`` and ``weight_sync_bytes`` of the publication of the new
version, ``rollout_mismatch_kl`` from ``services/_mismatch.py``), ``rollout`` (each Rollout worker, one per engine
call: ``tokens``, ``seconds``, and per version applied ``weight_sync_s`` (fetch) and ``weight_load_s`` (load into the
engine)), ``device_memory`` (a service's process peak CUDA memory: ``peak_mib``, ``reserved_mib``; also any record's
``device_peak_mib``) and ``summary`` (``stop_reason``, ``error``).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypedDict

from relax_services.reporting.metrics import read_metrics

__all__ = [
    "Device",
    "Fetch",
    "Gpu",
    "JunitCounts",
    "LayoutRun",
    "Machine",
    "MismatchFigures",
    "MismatchPoint",
    "ModelInfo",
    "Publication",
    "PytestStep",
    "Report",
    "RunFigures",
    "SkippedLayout",
    "WeightSync",
    "format_report",
    "passed",
    "summarize_metrics",
    "summarize_records",
]

Record = Mapping[str, object]
"""One ``metrics.jsonl`` record (a JSON object)."""


class Publication(TypedDict):
    """The Trainer's publication of one version's weights."""

    version: int
    publish_s: float
    bytes: int | None
    gb_per_s: float | None


class Fetch(TypedDict):
    """One Rollout worker's fetch and load of one version's weights (GB/s of the two together)."""

    service: str
    version: int
    fetch_s: float
    load_s: float
    gb_per_s: float | None


class WeightSync(TypedDict):
    """Weight sync per version, its medians, and why GB/s is missing (None when it is not)."""

    trainer: list[Publication]
    rollout: list[Fetch]
    publish_s_median: float | None
    publish_gb_per_s_median: float | None
    rollout_gb_per_s_median: float | None
    note: str | None


class MismatchPoint(TypedDict):
    """``rollout_mismatch_kl`` of one update."""

    version: int
    kl: float


class MismatchFigures(TypedDict):
    """The rollout/trainer log-prob mismatch per update, its mean and max."""

    per_update: list[MismatchPoint]
    mean: float
    max: float


class RunFigures(TypedDict):
    """One run's figures (:func:`summarize_records`)."""

    updates: int
    first_update_wall_s: float | None
    train_span_s: float | None
    samples_per_s: float | None
    tokens_per_s: float | None
    rollout_tokens_per_s: float | None
    weight_sync: WeightSync
    device_peak_mib: dict[str, float] | None
    device_reserved_mib: dict[str, float] | None
    device_memory_note: str | None
    rollout_mismatch_kl: MismatchFigures | None
    stop_reason: str | None
    error: str | None


Device = Literal["cuda", "cpu"]
"""Where the check runs its layouts."""


class SkippedLayout(TypedDict):
    """A layout the machine cannot run, and why."""

    name: str
    reason: str


class Gpu(TypedDict):
    """One GPU as ``nvidia-smi`` lists it."""

    index: int
    name: str
    memory_mib: int
    driver: str


class Machine(TypedDict):
    """The machine the check ran on."""

    python: str
    cpus: int | None
    packages: dict[str, str | None]
    gpus: list[Gpu] | None


class JunitCounts(TypedDict):
    """Outcomes of a pytest run (:func:`~relax_services.bench.gpu_check.parse_junit`)."""

    passed: int
    failed: int
    skipped: int
    errors: int
    failed_tests: list[str]


class PytestStep(TypedDict):
    """The ``pytest -m gpu`` step: not run (``reason``), or its command, exit code, seconds and counts (the log's
    last lines when a test failed or no counts were written)."""

    ran: bool
    reason: str | None
    command: list[str] | None
    returncode: int | None
    seconds: float | None
    log: str | None
    log_tail: list[str] | None
    counts: JunitCounts | None


class ModelInfo(TypedDict):
    """The checkpoint the runs train (:func:`~relax_services.bench.gpu_check.build_checkpoint`)."""

    path: str
    family: str
    shape: str
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    parameters: int
    parameters_with_published_vocab: int | None
    note: str | None
    seconds: float


class LayoutRun(TypedDict):
    """One layout's ``relax train``: the command, its exit code and seconds, and its run's figures (None without a
    ``metrics.jsonl``); ``error`` and the log's last lines when it did not end with exit code 0."""

    name: str
    description: str
    command: list[str]
    returncode: int | None
    command_s: float
    run_dir: str
    log: str
    log_tail: list[str] | None
    figures: RunFigures | None
    error: str | None


class Report(TypedDict):
    """``gpu_check.json``."""

    device: Device
    rollout_engine: str  # vllm or hf (the transformers engine)
    machine: Machine
    tests: PytestStep
    model: ModelInfo
    layouts: list[LayoutRun]
    layouts_skipped: list[SkippedLayout]
    seconds: float


@dataclass(frozen=True)
class _Update:
    """The fields of a ``train`` record read here."""

    step: int
    time: float
    wall: float
    samples: int
    tokens: float
    publish_s: float
    publish_bytes: int | None
    mismatch_kl: float | None


@dataclass(frozen=True)
class _Call:
    """The fields of a ``rollout`` record read here."""

    service: str
    tokens: float
    seconds: float
    fetch_s: dict[int, float]
    load_s: dict[int, float]


def summarize_metrics(path: Path) -> RunFigures:
    """:func:`summarize_records` of the records in ``path`` (a run folder's ``metrics.jsonl``)."""
    return summarize_records(read_metrics(path))


def summarize_records(records: Iterable[Record]) -> RunFigures:
    """One run's figures from its metric records.

    Returns:
        ``updates`` (the highest trainer step), ``first_update_wall_s`` (seconds from the run's start to the first
        update's record), ``train_span_s`` (the Trainer's clock from the first update's record to the last),
        ``samples_per_s`` and ``tokens_per_s`` (samples and trained tokens of the updates after the first over that
        span: the first update is left out, as the span starts at its end; None with fewer than two updates),
        ``rollout_tokens_per_s`` (generated tokens over the engines' generating seconds), ``weight_sync``,
        ``device_peak_mib`` / ``device_reserved_mib`` (per service, or None with ``device_memory_note`` saying why),
        ``rollout_mismatch_kl`` (None when no update reported it), ``stop_reason`` and ``error`` (from the run's
        summary record).

    Raises:
        ValueError: a record read here lacks a field or holds a value of another type (the message names both).
    """
    rows = list(records)
    updates = sorted((_update(r) for r in rows if r.get("kind") == "train"), key=lambda u: u.step)
    calls = [_call(r) for r in rows if r.get("kind") == "rollout"]
    summary = next((r for r in reversed(rows) if r.get("kind") == "summary"), {})
    span = updates[-1].time - updates[0].time if len(updates) >= 2 else None
    later = updates[1:]
    peak, reserved = _device_memory(rows)
    return {
        "updates": max((u.step for u in updates), default=0),
        "first_update_wall_s": updates[0].wall if updates else None,
        "train_span_s": span,
        "samples_per_s": None if span is None else _ratio(sum(u.samples for u in later), span),
        "tokens_per_s": None if span is None else _ratio(sum(u.tokens for u in later), span),
        "rollout_tokens_per_s": _ratio(sum(c.tokens for c in calls), sum(c.seconds for c in calls)),
        "weight_sync": _weight_sync(updates, calls),
        "device_peak_mib": peak or None,
        "device_reserved_mib": reserved or None,
        "device_memory_note": None
        if peak
        else (
            "not recorded: no device_memory record and no device_peak_mib field (a CPU run, or services that do not "
            "report their CUDA memory)"
        ),
        "rollout_mismatch_kl": _mismatch(updates),
        "stop_reason": _text(summary, "stop_reason"),
        "error": _text(summary, "error"),
    }


def _number(record: Record, key: str) -> float:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"metrics record of kind {record.get('kind')!r}: {key}={value!r} is not a number")
    return float(value)


def _optional_number(record: Record, key: str) -> float | None:
    return _number(record, key) if record.get(key) is not None else None


def _per_version(record: Record, key: str) -> dict[int, float]:
    """A ``{version: seconds}`` field (JSON keys are strings)."""
    value = record.get(key, {})
    if not isinstance(value, Mapping):
        raise ValueError(f"metrics record of kind {record.get('kind')!r}: {key}={value!r} is not an object")
    return {int(version): _number(value, version) for version in value}


def _text(record: Record, key: str) -> str | None:
    value = record.get(key)
    return None if value is None else str(value)


def _update(record: Record) -> _Update:
    size = _optional_number(record, "weight_sync_bytes")
    return _Update(
        step=int(_number(record, "step")),
        time=_number(record, "time"),
        wall=_number(record, "wall"),
        samples=int(_number(record, "samples")),
        tokens=_number(record, "tokens"),
        publish_s=_number(record, "weight_sync_s"),
        publish_bytes=None if size is None else int(size),
        mismatch_kl=_optional_number(record, "rollout_mismatch_kl"),
    )


def _call(record: Record) -> _Call:
    return _Call(
        service=str(record.get("service", "?")),
        tokens=_number(record, "tokens"),
        seconds=_number(record, "seconds"),
        fetch_s=_per_version(record, "weight_sync_s"),
        load_s=_per_version(record, "weight_load_s"),
    )


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _gb_per_s(num_bytes: int | None, seconds: float) -> float | None:
    return None if num_bytes is None else _ratio(num_bytes / 1e9, seconds)


def _median(values: Iterable[float | None]) -> float | None:
    """The median of the known values (None: none known)."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _weight_sync(updates: list[_Update], calls: list[_Call]) -> WeightSync:
    """The Trainer's publication per version and each Rollout worker's fetch + load of it; GB/s where the bytes are
    recorded (``weight_sync_bytes``, the publication's, which is what a worker reads)."""
    sizes = {u.step: u.publish_bytes for u in updates if u.publish_bytes is not None}
    published: list[Publication] = [
        {
            "version": u.step,
            "publish_s": u.publish_s,
            "bytes": u.publish_bytes,
            "gb_per_s": _gb_per_s(u.publish_bytes, u.publish_s),
        }
        for u in updates
    ]
    fetched: list[Fetch] = [
        {
            "service": c.service,
            "version": version,
            "fetch_s": fetch_s,
            "load_s": c.load_s.get(version, 0.0),
            "gb_per_s": _gb_per_s(sizes.get(version), fetch_s + c.load_s.get(version, 0.0)),
        }
        for c in calls
        for version, fetch_s in c.fetch_s.items()
    ]
    return {
        "trainer": published,
        "rollout": sorted(fetched, key=lambda f: (f["service"], f["version"])),
        "publish_s_median": _median(p["publish_s"] for p in published),
        "publish_gb_per_s_median": _median(p["gb_per_s"] for p in published),
        "rollout_gb_per_s_median": _median(f["gb_per_s"] for f in fetched),
        "note": None if sizes else "no weight_sync_bytes in the train records: GB/s not known",
    }


def _device_memory(rows: list[Record]) -> tuple[dict[str, float], dict[str, float]]:
    """Peak and reserved device memory per service, MiB: the largest of its ``device_memory`` records
    (``peak_mib``, ``reserved_mib``) and of any record's ``device_peak_mib``."""
    peak: dict[str, float] = {}
    reserved: dict[str, float] = {}
    for r in rows:
        service = str(r.get("service", "?"))
        key = "peak_mib" if r.get("kind") == "device_memory" else "device_peak_mib"
        if (value := _optional_number(r, key)) is not None:
            peak[service] = max(peak.get(service, 0.0), value)
        if r.get("kind") == "device_memory" and (value := _optional_number(r, "reserved_mib")) is not None:
            reserved[service] = max(reserved.get(service, 0.0), value)
    return peak, reserved


def _mismatch(updates: list[_Update]) -> MismatchFigures | None:
    """``rollout_mismatch_kl`` per update (present when the update had tokens of the version it trained from)."""
    points: list[MismatchPoint] = [
        {"version": u.step, "kl": u.mismatch_kl} for u in updates if u.mismatch_kl is not None
    ]
    if not points:
        return None
    kls = [p["kl"] for p in points]
    return {"per_update": points, "mean": statistics.fmean(kls), "max": max(kls)}


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def _layout_line(run: LayoutRun) -> str:
    head = f"{run['name']}: exit {run['returncode']} after {run['command_s']} s"
    fig = run["figures"]
    if fig is None:
        return head
    sync = fig["weight_sync"]
    peak = fig["device_peak_mib"]
    mismatch = fig["rollout_mismatch_kl"]
    return (
        f"{head}; {fig['updates']} updates, {_fmt(fig['samples_per_s'], '.1f')} samples/s, "
        f"{_fmt(fig['tokens_per_s'], '.0f')} tokens/s; publish {_fmt(sync['publish_s_median'], '.3f', ' s')} "
        f"({_fmt(sync['publish_gb_per_s_median'], '.2f', ' GB/s')}) median; peak MiB "
        f"{', '.join(f'{k} {v:.0f}' for k, v in peak.items()) if peak else 'not recorded'}; "
        f"rollout mismatch KL max {_fmt(None if mismatch is None else mismatch['max'], '.2e')}"
    )


def format_report(report: Report) -> str:
    """A few lines for the terminal: machine, tests, model, and each layout's main figures."""
    gpus = report["machine"]["gpus"]
    names = ", ".join(g["name"] for g in gpus) if gpus else "none"
    lines = [f"gpu check ({report['device']}, rollout engine {report['rollout_engine']}): GPUs: {names}"]
    tests, counts = report["tests"], report["tests"]["counts"]
    if not tests["ran"]:
        lines.append(f"tests: not run ({tests['reason']})")
    elif counts is None:
        lines.append(f"tests: pytest exited with {tests['returncode']} and wrote no junit xml; see {tests['log']}")
    else:
        outcomes = ", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "skipped", "errors"))
        lines += [f"tests (pytest -m gpu): {outcomes} in {tests['seconds']} s"]
        lines += [f"  failed: {name}" for name in counts["failed_tests"]]
    model = report["model"]
    lines.append(f"model: {model['shape']}, {model['parameters'] / 1e6:.1f} M parameters")
    for run in report["layouts"]:
        lines.append(_layout_line(run))
        lines += [f"  error: {e}" for e in (run["error"], run["figures"] and run["figures"]["error"]) if e]
    lines += [f"{s['name']}: skipped ({s['reason']})" for s in report["layouts_skipped"]]
    return "\n".join(lines)


def passed(report: Report) -> bool:
    """Whether no test failed or erred and every layout that ran ended with exit code 0."""
    tests, counts = report["tests"], report["tests"]["counts"]
    tests_ok = not tests["ran"] or (counts is not None and counts["failed"] == counts["errors"] == 0)
    return tests_ok and all(run["returncode"] == 0 for run in report["layouts"])
