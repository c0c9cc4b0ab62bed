"""The figures of ``relax bench trl`` from each side's timeline: one side's summary, the side-by-side table with
ratios and the per-seed spread (no process is run here; :mod:`relax_services.bench.trl` runs the sides)."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from relax_services.reporting.footprint import UpdateSplit

__all__ = [
    "SKIP",
    "THRESHOLDS",
    "WINDOW",
    "MemoryEstimate",
    "SideResult",
    "crossing",
    "format_config_table",
    "format_spread",
    "format_table",
    "median_update_s",
    "memory_estimate",
    "summarise",
]

THRESHOLDS = (0.3, 0.5, 0.8)
WINDOW = 10  # updates in the moving average of the training reward
SKIP = 10  # first updates left out of the per-update median (allocator and cache warm-up)


@dataclass
class SideResult:
    """One side's timeline and what is derived from it.

    Attributes:
        name: Column header.
        start: Wall time the command was launched.
        times: Wall time each update ended.
        rewards: Mean training reward of each update's batch.
        samples: Completions per update.
        peak_bytes: Peak PSS of the side's process tree.
        wall_s: Command start to process exit.
        split: A relax side's per-update split from its run's metrics (None for TRL).
        peak_processes: At the peak, each process label's PSS bytes (:attr:`~relax_services.reporting.footprint.\
PeakMemory.peak_processes`).
        heldout_reward: The held-out reward at the end (``--config`` mode; None when not measured).
        heldout_curve: A relax side's held-out rewards as its run went: (seconds into the run, reward).
        cpu_s: CPU seconds (user + system) of the side's processes that were waited for, command to exit: on a
            shared machine the measure of work that other processes' load does not inflate, as wall-clock is. It
            misses the processes Ray's shutdown kills without waiting for them (its workers: a distributed side's
            figure is a lower bound).
    """

    name: str
    start: float
    times: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    samples: int = 0
    peak_bytes: int = 0
    wall_s: float = 0.0
    split: UpdateSplit | None = None
    peak_processes: dict[str, list[int]] = field(default_factory=dict)
    heldout_reward: float | None = None
    heldout_curve: list[tuple[float, float]] = field(default_factory=list)
    cpu_s: float = 0.0


def crossing(times: Sequence[float], rewards: Sequence[float], threshold: float, window: int = WINDOW) -> int | None:
    """Index of the first update whose moving-average reward over the last ``window`` updates (a full window:
    one lucky early batch does not count) is ≥ ``threshold``; None when it never is."""
    total = 0.0
    for i, r in enumerate(rewards):
        total += r
        if i >= window:
            total -= rewards[i - window]
        if i + 1 >= window and total / window >= threshold:
            return i
    return None


def summarise(side: SideResult) -> dict[str, float | None]:
    """The figures of one side (None where undefined: no update, or a threshold never reached)."""
    out: dict[str, float | None] = {}
    times = side.times
    out["startup_s"] = times[0] - side.start if times else None
    gaps = [b - a for a, b in zip(times[SKIP:], times[SKIP + 1 :], strict=False)]
    out["s_per_update"] = statistics.median(gaps) if gaps else None
    out["samples_per_s"] = side.samples / out["s_per_update"] if out["s_per_update"] else None
    for t in THRESHOLDS:
        i = crossing(times, side.rewards, t)
        out[f"updates_to_{t}"] = None if i is None else float(i + 1)
        out[f"wall_to_{t}"] = None if i is None else times[i] - side.start
        # The same at the side's median pace: what the wall-clock would be without the stalls a shared machine
        # puts into some stretches of a run (an estimate, labelled as one in the table).
        startup, pace = out["startup_s"], out["s_per_update"]
        out[f"paced_to_{t}"] = None if i is None or startup is None or pace is None else startup + i * pace
    out["final_reward"] = statistics.fmean(side.rewards[-WINDOW:]) if side.rewards else None
    out["peak_gb"] = side.peak_bytes / 1e9
    out["wall_s"] = side.wall_s
    split = side.split
    out["interval_s"] = None if split is None else split.interval_s
    out["compute_s"] = None if split is None else split.compute_s
    out["publish_s"] = None if split is None else split.publish_s
    out["wait_s"] = None if split is None else split.wait_s
    out["queue_s"] = None if split is None else split.queue_s
    out["other_s"] = None if split is None else split.other_s
    return out


def _fmt(value: float | None, unit: str = "", missing: str = "not reached") -> str:
    if value is None:
        return missing
    if unit == "GB":
        return f"{value:.2f} GB"
    if unit == "n":
        return f"{value:.0f}"
    return f"{value:.3f}{unit}" if value < 1 else f"{value:.1f}{unit}"


def format_table(sides: list[SideResult]) -> str:
    """Markdown table of the figures, relax columns with their ratio to TRL's (the first side)."""
    rows: list[tuple[str, str, str]] = [
        ("command → first update", "startup_s", "s"),
        ("median seconds per update", "s_per_update", "s"),
        ("samples/s", "samples_per_s", "n"),
    ]
    for t in THRESHOLDS:
        rows.append((f"updates to moving-avg reward {t}", f"updates_to_{t}", "n"))
        rows.append((f"wall s to moving-avg reward {t}", f"wall_to_{t}", "s"))
        rows.append(("  same at the median pace (estimate)", f"paced_to_{t}", "s"))
    rows += [
        ("training reward, last 10 updates", "final_reward", ""),
        ("peak PSS of the process tree", "peak_gb", "GB"),
        ("command wall-clock (incl. exit)", "wall_s", "s"),
    ]
    # relax's per-update split (medians; TRL has no such split): where the seconds per update go
    split_rows = [
        ("relax trainer: interval between updates", "interval_s"),
        ("  compute (batch, forward, backward, step)", "compute_s"),
        ("  publish weights", "publish_s"),
        ("  wait for a complete batch", "wait_s"),
        ("  queue calls besides the get (ack + version)", "queue_s"),
        ("  outside these (record, loop, GIL)", "other_s"),
    ]
    figures = [summarise(s) for s in sides]
    head = "| | " + " | ".join(s.name for s in sides) + " |"
    lines = [head, "|" + " --- |" * (len(sides) + 1)]
    for label, key, unit in rows:
        base = figures[0][key]
        cells = []
        for i, f in enumerate(figures):
            value = f[key]
            text = _fmt(value, unit)
            if i and base and value is not None:
                text += f" ({value / base:.2f}×)"
            cells.append(text)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if any(f["compute_s"] is not None for f in figures):
        for label, key in split_rows:
            cells = [_fmt(f[key], "s", missing="—") for f in figures]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value: float) -> str:
    return "—" if math.isinf(value) else f"{value:.0f}"


def _spread_table(
    by_seed: Mapping[int, Sequence[SideResult]], key: str, what: str
) -> tuple[list[str], dict[str, list[float]]]:
    """One spread table of ``{key}_{threshold}`` (updates or wall seconds): a row per seed, then the medians;
    returns its lines and each side's medians per threshold (a threshold never reached counts as infinite)."""
    names = [s.name for s in next(iter(by_seed.values()))]
    counts: dict[str, list[list[float]]] = {name: [[] for _ in THRESHOLDS] for name in names}
    head = "| seed | " + " | ".join(f"{n}: {what} {' / '.join(str(t) for t in THRESHOLDS)}" for n in names) + " |"
    lines = [head, "|" + " --- |" * (len(names) + 1)]
    for seed, sides in by_seed.items():
        cells = []
        for side in sides:
            figures = summarise(side)
            values = [figures[f"{key}_{t}"] for t in THRESHOLDS]
            for k, v in enumerate(values):
                counts[side.name][k].append(math.inf if v is None else v)
            cells.append(" / ".join(_cell(math.inf if v is None else v) for v in values))
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    medians = {n: [statistics.median(c) for c in counts[n]] for n in names}
    lines.append("| median | " + " | ".join(" / ".join(_cell(m) for m in medians[n]) for n in names) + " |")
    return lines, medians


def _ratio(value: float, base: float) -> str:
    return "—" if math.isinf(value) or math.isinf(base) or base == 0 else f"{value / base:.2f}×"


def format_spread(by_seed: Mapping[int, Sequence[SideResult]]) -> str:
    """Markdown tables of the updates and of the wall seconds from the command to each reward threshold, one row
    per seed, a median row per side, the medians' ratios to the first side (TRL) and how many runs reached each
    threshold.

    A threshold a side never reached counts as infinitely many updates (seconds), so a median of "—" means that
    more than half of the seeds (half, for an even count) did not reach it; a ratio with such a median is "—".
    """
    names = [s.name for s in next(iter(by_seed.values()))]
    lines: list[str] = []
    for key, what in (("updates_to", "updates to"), ("wall_to", "wall s to")):
        table, medians = _spread_table(by_seed, key, what)
        if lines:
            lines.append("")
        lines += table
        base = medians[names[0]]
        ratios = [" / ".join(_ratio(m, b) for m, b in zip(medians[n], base, strict=True)) for n in names]
        lines.append("| median ratio to the first side | " + " | ".join(ratios) + " |")
    reached = []
    for i, name in enumerate(names):
        sums = [
            sum(summarise(sides[i])[f"updates_to_{t}"] is not None for sides in by_seed.values()) for t in THRESHOLDS
        ]
        reached.append(" / ".join(f"{k} of {len(by_seed)}" for k in sums))
        assert all(sides[i].name == name for sides in by_seed.values())  # every seed ran the same sides
    lines.append("| runs that reached it | " + " | ".join(reached) + " |")
    return "\n".join(lines)


@dataclass(frozen=True)
class MemoryEstimate:
    """Where a training process's memory goes, from the checkpoint's size.

    Attributes:
        params: Parameters of the checkpoint (a tied embedding once).
        weights_bytes: ``params`` × 4 (float32, what both sides train in on the CPU).
        optimizer_bytes: AdamW's two moments: 2 × ``params`` × 4.
    """

    params: int
    weights_bytes: int
    optimizer_bytes: int

    def rest(self, peak_bytes: int) -> int:
        """Peak less the weights and the optimizer state: the gradients (another ``params`` × 4 on a side that
        keeps them), activations, runtime, extra copies of the weights, the object store."""
        return peak_bytes - self.weights_bytes - self.optimizer_bytes


def memory_estimate(model_dir: Path) -> MemoryEstimate:
    """The estimate for the checkpoint folder ``model_dir``, its parameters counted from the safetensors headers
    (no weight is read)."""
    params = 0
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for path in files:
        with path.open("rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                params += _numel(entry["shape"])
    return MemoryEstimate(params, params * 4, 2 * params * 4)


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def median_update_s(times: Sequence[float]) -> float | None:
    """Median seconds between consecutive updates, the first quarter of the gaps (at most :data:`SKIP`) left out
    as warm-up: a run of a real model for a few minutes makes tens of updates, not hundreds. None: under two
    updates."""
    gaps = [b - a for a, b in itertools.pairwise(times)]
    if not gaps:
        return None
    return statistics.median(gaps[min(SKIP, len(gaps) // 4) :])


def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def _with_ratio(text: str, value: float | None, base: float | None) -> str:
    return text if value is None or not base else f"{text} ({value / base:.2f}×)"


def format_config_table(sides: Sequence[SideResult], estimate: MemoryEstimate, notes: Sequence[str] = ()) -> str:
    """``--config`` mode's markdown table: per side the updates made, median seconds per update, held-out reward
    at the end, peak PSS with the estimate of where it goes, and each relax side's ratio to TRL's (the first side);
    then each side's PSS per process at its peak and the ``notes`` (what is not held equal)."""
    base = sides[0]
    base_s = median_update_s(base.times)
    head = "| | " + " | ".join(s.name for s in sides) + " |"
    lines = [head, "|" + " --- |" * (len(sides) + 1)]

    def row(label: str, cells: list[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    row("updates", [str(len(s.times)) for s in sides])
    pace = [median_update_s(s.times) for s in sides]
    row(
        "median seconds per update",
        [
            _with_ratio("—" if p is None else f"{p:.2f} s", p, base_s) if i else ("—" if p is None else f"{p:.2f} s")
            for i, p in enumerate(pace)
        ],
    )
    rewards = [s.heldout_reward for s in sides]
    row("held-out reward at the end", ["—" if r is None else f"{r:.3f}" for r in rewards])
    row("wall-clock, command to exit", [f"{s.wall_s:.0f} s" for s in sides])
    row(
        "CPU seconds of waited processes (Ray's workers missed)",
        [
            _with_ratio(f"{s.cpu_s:.0f} s", s.cpu_s, base.cpu_s) if i else f"{s.cpu_s:.0f} s"
            for i, s in enumerate(sides)
        ],
    )
    row(
        "peak PSS of the process tree",
        [
            _with_ratio(_mb(s.peak_bytes), s.peak_bytes, base.peak_bytes) if i else _mb(s.peak_bytes)
            for i, s in enumerate(sides)
        ],
    )
    row(f"  weights ({estimate.params:,} params × 4 B)", [_mb(estimate.weights_bytes)] * len(sides))
    row("  AdamW moments (2 × params × 4 B)", [_mb(estimate.optimizer_bytes)] * len(sides))
    row(
        "  the rest (gradients, activations, runtime, copies, object store)",
        [_mb(estimate.rest(s.peak_bytes)) for s in sides],
    )
    lines.append("")
    for side in sides:
        parts = []
        for label, sizes in sorted(side.peak_processes.items(), key=lambda kv: -sum(kv[1])):
            each = " + ".join(_mb(n) for n in sizes)
            parts.append(f"{label} {each}" if len(sizes) == 1 else f"{label} ×{len(sizes)} {each}")
        lines.append(f"- {side.name}, per process at its peak (PSS): {', '.join(parts) or '—'}")
    for side in sides:
        if side.heldout_curve:
            curve = ", ".join(f"{wall:.0f} s {reward:.3f}" for wall, reward in side.heldout_curve)
            lines.append(f"- {side.name}, held-out reward by seconds into its run: {curve}")
    lines += [f"- not held equal: {note}" for note in notes]
    return "\n".join(lines)
