"""Metrics sinks besides ``metrics.jsonl``: TensorBoard, W&B and MLflow, each fed the same digest of the records.

A record of kind ``train``, ``eval`` or ``rollout`` becomes scalars at one step (:data:`STEP_FIELDS`): every finite
number in it, nested mappings flattened with ``/`` (``train/reward_by_task/text``); a ``train`` record also gives
two histograms, ``train/staleness`` (its samples' staleness, from ``staleness_hist``) and ``train/rewards`` (its
samples' rewards). Each sink receives the run config when it opens. Sinks are listed in :data:`SINKS` by dotted path
and imported only when a run asks for them (``metrics.sinks``); the config refuses one whose package is missing.
"""

from __future__ import annotations

import bisect
import contextlib
import importlib
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from relax_services.config import MetricsConfig

__all__ = [
    "SINKS",
    "STEP_FIELDS",
    "Digest",
    "Histogram",
    "MetricsSink",
    "SinkFanout",
    "digest",
    "histogram_of",
    "open_sinks",
]

SINKS: dict[str, str] = {
    "tensorboard": "relax_services.reporting.sinks._tensorboard:TensorBoardSink",
    "wandb": "relax_services.reporting.sinks._wandb:WandbSink",
    "mlflow": "relax_services.reporting.sinks._mlflow:MlflowSink",
}
"""Sink name (``metrics.sinks``) → ``module:class`` of its :class:`MetricsSink`, imported when a run asks for it."""

STEP_FIELDS: dict[str, str] = {"train": "step", "eval": "version", "rollout": "version"}
"""Record kind → its field that is the step of its scalars (the policy version the record speaks of)."""

_HISTOGRAM_FIELDS = frozenset({"staleness_hist", "token_staleness_hist", "rewards"})
"""Fields of a ``train`` record that are distributions, not scalars."""

_FLOAT_BINS = 20
"""Equal-width bins of a histogram of non-integer values, or of integers spread wider than :data:`_INTEGER_BINS`."""

_INTEGER_BINS = 64
"""Integer values spanning fewer than this many integers get one bin per integer (W&B takes at most 512 bins)."""


@dataclass(frozen=True)
class Histogram:
    """A histogram: ``len(edges) == len(counts) + 1``; bin ``i`` holds the values in ``[edges[i], edges[i+1])``
    (the last bin includes its right edge)."""

    edges: list[float]
    counts: list[int]
    values: list[float]  # the values themselves: sinks that bin on their own (or store raw values) use them


@dataclass(frozen=True)
class Digest:
    """What the sinks receive of one record: its scalars and histograms at one step."""

    kind: str
    step: int
    scalars: dict[str, float]  # tag (``kind/field``) → value, finite only
    histograms: dict[str, Histogram]  # tag → histogram


class MetricsSink(Protocol):
    """A place metrics go. Built as ``Sink(run_dir, config, config_text, settings)``: ``config`` is the run config
    as plain data, ``config_text`` its YAML, ``settings`` the run's ``metrics`` section."""

    def write(self, item: Digest) -> None:
        """Record one digest (scalars and histograms at ``item.step``)."""
        ...

    def close(self) -> None:
        """Flush and release everything (files, a background process)."""
        ...


def histogram_of(values: list[float]) -> Histogram:
    """Bins ``values``: one bin per integer when every value is an integer and they span fewer than
    :data:`_INTEGER_BINS` integers (staleness, 0/1 rewards), else :data:`_FLOAT_BINS` equal-width bins from the
    smallest to the largest value."""
    finite = [float(v) for v in values if math.isfinite(v)]
    if not finite:
        return Histogram([], [], [])
    low, high = min(finite), max(finite)
    if all(v.is_integer() for v in finite) and high - low < _INTEGER_BINS:
        edges = [low - 0.5 + i for i in range(int(high - low) + 2)]
    elif low == high:
        edges = [low - 0.5, high + 0.5]
    else:
        width = (high - low) / _FLOAT_BINS
        edges = [low + i * width for i in range(_FLOAT_BINS)] + [high]
    counts = [0] * (len(edges) - 1)
    for v in finite:
        counts[min(bisect.bisect_right(edges, v) - 1, len(counts) - 1)] += 1  # the last bin holds its right edge
    return Histogram(edges, counts, finite)


def _flatten(prefix: str, value: object, out: dict[str, float]) -> None:
    if isinstance(value, bool):
        return
    if isinstance(value, int | float):
        if math.isfinite(value):
            out[prefix] = float(value)
    elif isinstance(value, Mapping):
        for key, inner in value.items():
            _flatten(f"{prefix}/{key}", inner, out)


def digest(kind: str, row: Mapping[str, object]) -> Digest | None:
    """The scalars and histograms of one ``metrics.jsonl`` record (None: a kind the sinks do not chart)."""
    step_field = STEP_FIELDS.get(kind)
    step = row.get(step_field) if step_field is not None else None
    if not isinstance(step, int) or isinstance(step, bool):
        return None
    scalars: dict[str, float] = {}
    for key, value in row.items():
        if key not in ("kind", "nonfinite") and key not in _HISTOGRAM_FIELDS:
            _flatten(f"{kind}/{key}", value, scalars)
    histograms: dict[str, Histogram] = {}
    staleness = row.get("staleness_hist")
    if isinstance(staleness, Mapping) and staleness:
        histograms[f"{kind}/staleness"] = histogram_of([float(k) for k, n in staleness.items() for _ in range(int(n))])
    rewards = row.get("rewards")
    if isinstance(rewards, list) and rewards:
        histograms[f"{kind}/rewards"] = histogram_of([float(r) for r in rewards if isinstance(r, int | float)])
    return Digest(kind, step, scalars, {t: h for t, h in histograms.items() if h.counts})


def open_sinks(
    names: Sequence[str], run_dir: Path, config: Mapping[str, object], config_text: str, settings: MetricsConfig
) -> list[MetricsSink]:
    """Open the sinks ``names`` (``jsonl`` is the metrics file itself, not one of these) for the run in
    ``run_dir``, each given the run config."""
    sinks: list[MetricsSink] = []
    for name in names:
        if name == "jsonl":
            continue
        module, _, attr = SINKS[name].partition(":")
        sinks.append(getattr(importlib.import_module(module), attr)(run_dir, config, config_text, settings))
    return sinks


class SinkFanout:
    """Hands each record's :class:`Digest` to every sink. A sink that raises is closed and dropped, with one line on
    stderr: a dashboard's failure never stops the run (``metrics.jsonl`` still has every record)."""

    def __init__(self, sinks: list[MetricsSink]) -> None:
        self.sinks = list(sinks)
        self.dropped: dict[str, str] = {}  # sink class → the error that dropped it

    def write(self, kind: str, row: Mapping[str, object]) -> None:
        """Send ``row`` (a record of kind ``kind``) to every sink."""
        item = digest(kind, row) if self.sinks else None
        if item is None:
            return
        for sink in list(self.sinks):
            try:
                sink.write(item)
            except Exception as exc:
                self._drop(sink, exc)

    def close(self) -> None:
        """Close every sink (each once, errors reported, never raised)."""
        for sink in list(self.sinks):
            try:
                sink.close()
            except Exception as exc:
                self._drop(sink, exc, closing=True)
        self.sinks.clear()

    def _drop(self, sink: MetricsSink, exc: Exception, closing: bool = False) -> None:
        name = type(sink).__name__
        self.dropped[name] = f"{type(exc).__name__}: {exc}"
        print(
            f"relax: metrics sink {name} failed ({self.dropped[name]}); metrics.jsonl has every record", file=sys.stderr
        )
        if sink in self.sinks:
            self.sinks.remove(sink)
        if not closing:
            with contextlib.suppress(Exception):  # already failing: the line above said so
                sink.close()
