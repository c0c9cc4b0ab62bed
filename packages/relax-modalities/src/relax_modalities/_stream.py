"""A resumable stream of records over several dataset files: weighted mixing and a bounded shuffle buffer.

The stream reads each source in row order into a bounded shuffle buffer of its own, draws which source gives
the next row by weight (so a weight changed with ``set_weights`` acts on the very next row), hands out a
random row of that source's buffer, and skips (and counts) bad rows. Its ``state_dict`` names the buffered
rows by ``(source, row)`` rather than holding their contents (inline media would bloat checkpoints);
``load_state_dict`` reads them back, so a resumed stream yields exactly what the uninterrupted one would.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from relax_core import DataFileSpec  # lives in relax-core: run configs load it without torch
from relax_modalities._rows import (
    BadRow,
    DataRecord,
    RowSchema,
    media_columns,
    parse_row,
    required_columns,
    schema_columns,
)
from relax_modalities._sources import DataFileError, RowSource, open_source

__all__ = [
    "BadRowInfo",
    "BadRowStats",
    "DataFileSpec",
    "DataStream",
    "build_stream",
]

_log = logging.getLogger(__name__)
_KEEP_BAD = 100  # most recent bad rows kept in full (file, row, reason); all are counted


@dataclass(frozen=True)
class BadRowInfo:
    """One skipped row: which file, which row, why."""

    source: str
    row: int
    reason: str


@dataclass
class BadRowStats:
    """Skipped rows (counted on each source's first pass only, so epochs do not multiply them).

    Attributes:
        total: All skipped rows.
        by_source: Skipped rows per file.
        recent: The last 100 skipped rows in full.
    """

    total: int = 0
    by_source: dict[str, int] = field(default_factory=dict)
    recent: list[BadRowInfo] = field(default_factory=list)

    def add(self, info: BadRowInfo) -> None:
        """Count one skipped row."""
        self.total += 1
        self.by_source[info.source] = self.by_source.get(info.source, 0) + 1
        self.recent = [*self.recent[-(_KEEP_BAD - 1) :], info]


def check_columns(source: RowSource, schema: RowSchema) -> None:
    """Raise :class:`DataFileError` if ``source`` lacks a column the schema requires."""
    for alternatives in required_columns(schema):
        if not any(c in source.columns for c in alternatives):
            wanted = " or ".join(repr(c) for c in alternatives)
            raise DataFileError(source.name, f"has no column {wanted} (columns: {sorted(source.columns)})")


class DataStream(Iterator[DataRecord]):
    """Records from several sources, mixed by weight, shuffled in bounded buffers, resumable.

    Args:
        sources: The opened sources (see :func:`build_stream` to open files).
        schema: Column names and row rules.
        weights: One per source, relative; None weighs each source by its row count.
        shuffle_buffer: Rows held for shuffling, shared evenly by the sources (each holds at least one; 0 or 1:
            file order within each source).
        seed: Seeds the mixing and shuffling draws.
        epochs: Passes over each source (None: endless; each source restarts when it ends).

    Raises:
        DataFileError: A source lacks a required column.
        ValueError: ``weights`` does not match ``sources`` or is not positive, a source appears twice, or the
            schema's ``media_keys`` name an unregistered modality or a shared column (`media_columns`).
    """

    def __init__(
        self,
        sources: Sequence[RowSource],
        schema: RowSchema | None = None,
        *,
        weights: Sequence[float] | None = None,
        shuffle_buffer: int = 1024,
        seed: int = 0,
        epochs: int | None = 1,
    ) -> None:
        self.schema = schema or RowSchema()
        media_columns(self.schema)  # a media_keys entry naming no registered modality fails here, not per row
        for source in sources:
            check_columns(source, self.schema)
        if weights is None:
            weights = [float(max(1, len(s))) for s in sources]  # an empty file is simply never drawn
        self.sources = list(sources)
        self.weights = self._checked(weights)
        names = [s.name for s in sources]
        if len(set(names)) != len(names):
            raise ValueError(f"a dataset appears twice among {names}; give it once with its weight")
        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs must be >= 1 or None, got {epochs}")
        self.shuffle_buffer = max(1, shuffle_buffer)
        self._capacity = max(1, self.shuffle_buffer // max(1, len(sources)))  # rows buffered per source
        self.epochs = epochs
        self.seed = seed
        self.stats = BadRowStats()
        self._rng = random.Random(seed)
        self._next_row = [0] * len(sources)  # next row index to read, per source
        self._epoch = [0] * len(sources)
        self._good_in_pass = [0] * len(sources)
        self._active = [len(s) > 0 for s in sources]
        self._buffers: list[list[DataRecord]] = [[] for _ in sources]
        self._iters: list[Iterator[tuple[int, Mapping[str, Any] | str]] | None] = [None] * len(sources)
        self.yielded = 0

    def _checked(self, weights: Sequence[float]) -> list[float]:
        if len(weights) != len(self.sources) or any(not float(w) > 0 for w in weights):
            raise ValueError(f"weights must be {len(self.sources)} positive numbers, got {list(weights)}")
        return [float(w) for w in weights]

    def set_weights(self, weights: Sequence[float]) -> None:
        """Replace the sources' relative weights (one per source, in order); the next row is drawn by them.

        Raises:
            ValueError: Not one positive number per source.
        """
        self.weights = self._checked(weights)

    def __iter__(self) -> DataStream:
        return self

    def __next__(self) -> DataRecord:
        while True:
            live = [i for i, a in enumerate(self._active) if a or self._buffers[i]]
            if not live:
                raise StopIteration
            i = self._choose(live)
            buffer = self._buffers[i]
            while len(buffer) < self._capacity and self._active[i] and not self._draining(i):
                record = self._pull(i)
                if record is not None:
                    buffer.append(record)
            if buffer:  # else source i ended (its last pass done, or nothing but bad rows): draw again
                break
        j = self._rng.randrange(len(buffer))
        buffer[j], buffer[-1] = buffer[-1], buffer[j]
        self.yielded += 1
        return buffer.pop()

    def _draining(self, i: int) -> bool:
        """Whether source ``i``'s buffer still holds rows of a pass that has ended.

        A pass's rows all leave the buffer before the next pass is read, so passes never overlap: every row comes
        once per pass, and a buffer that holds the whole file hands out each pass as a uniform permutation (read
        across passes, it would hand out near draws with replacement: a row of the next pass can come before a row
        of this one). Derived from the buffered rows' epochs, so a restored state needs nothing more.
        """
        return any(record.epoch != self._epoch[i] for record in self._buffers[i])

    def _choose(self, live: list[int]) -> int:
        x = self._rng.random() * sum(self.weights[i] for i in live)
        for i in live:
            x -= self.weights[i]
            if x < 0:
                return i
        return live[-1]  # float round-off at the top end

    def _pull(self, i: int) -> DataRecord | None:
        """The next good row of source ``i`` (None when this pull hit a bad row or the end of a pass)."""
        if self._iters[i] is None:
            self._iters[i] = self.sources[i].iter_rows(self._next_row[i])
        iterator = self._iters[i]
        assert iterator is not None
        item = next(iterator, None)
        if item is None:
            self._end_pass(i)
            return None
        index, row = item
        self._next_row[i] = index + 1
        record = self._parse(i, index, row)
        if record is None:
            return None
        self._good_in_pass[i] += 1
        return replace(record, epoch=self._epoch[i])

    def _parse(self, i: int, index: int, row: Mapping[str, Any] | str) -> DataRecord | None:
        source = self.sources[i]
        try:
            if isinstance(row, str):
                raise BadRow(row)
            record = parse_row(row, self.schema, source.root)
        except BadRow as exc:
            if self._epoch[i] == 0:
                info = BadRowInfo(source.name, index, exc.reason)
                if self.stats.total < 10:  # the first few in the log; all of them in the stats
                    _log.warning("skipping row %d of %s: %s", index, source.name, exc.reason)
                self.stats.add(info)
            return None
        return replace(record, source=source.name, row=index)

    def _end_pass(self, i: int) -> None:
        self._iters[i] = None
        self._epoch[i] += 1
        # A source whose whole pass was bad rows would otherwise spin forever in an endless stream.
        more = self.epochs is None or self._epoch[i] < self.epochs
        self._active[i] = more and self._good_in_pass[i] > 0
        self._next_row[i] = 0
        self._good_in_pass[i] = 0

    def state_dict(self) -> dict[str, Any]:
        """Position of the stream: per-source row and epoch, the draw state, and the buffered rows by reference.

        Plain ints, strings and lists (JSON-serialisable).
        """
        version, internal, gauss = self._rng.getstate()
        return {
            "sources": [s.name for s in self.sources],
            "next_row": list(self._next_row),
            "epoch": list(self._epoch),
            "good_in_pass": list(self._good_in_pass),
            "active": list(self._active),
            "rng": [version, list(internal), gauss],
            "buffer": [[i, r.row, r.epoch] for i, buffer in enumerate(self._buffers) for r in buffer],
            "weights": list(self.weights),
            "yielded": self.yielded,
            "bad": {
                "total": self.stats.total,
                "by_source": dict(self.stats.by_source),
                "recent": [[b.source, b.row, b.reason] for b in self.stats.recent],
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict` of a stream over the same sources.

        Raises:
            ValueError: The state was taken over different sources.
        """
        names = [s.name for s in self.sources]
        if list(state["sources"]) != names:
            raise ValueError(f"stream state is over sources {state['sources']}, this stream reads {names}")
        self._next_row = list(state["next_row"])
        self._epoch = list(state["epoch"])
        self._good_in_pass = list(state["good_in_pass"])
        self._active = list(state["active"])
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))
        self._iters = [None] * len(self.sources)
        self.yielded = int(state["yielded"])
        bad = state["bad"]
        self.stats = BadRowStats(
            bad["total"], dict(bad["by_source"]), [BadRowInfo(s, r, why) for s, r, why in bad["recent"]]
        )
        if "weights" in state:
            self.weights = self._checked(state["weights"])
        self._buffers = [[] for _ in self.sources]
        for i, record in self._reread([(int(i), int(r), int(e)) for i, r, e in state["buffer"]]):
            self._buffers[i].append(record)

    def _reread(self, refs: list[tuple[int, int, int]]) -> list[tuple[int, DataRecord]]:
        """Read the referenced rows again (one forward scan per source), in the order given, with their source."""
        found: dict[tuple[int, int], DataRecord] = {}
        for i in {i for i, _, _ in refs}:
            wanted = {r for j, r, _ in refs if j == i}
            for index, row in self.sources[i].iter_rows(min(wanted)):
                if index in wanted:
                    record = self._parse(i, index, row)
                    if record is not None:
                        found[i, index] = record
                    wanted.discard(index)
                if not wanted:
                    break
        # A row that vanished or turned bad since the snapshot is dropped (and, on a first pass, counted).
        return [(i, replace(found[i, r], epoch=e)) for i, r, e in refs if (i, r) in found]


def build_stream(
    files: Sequence[str | os.PathLike[str] | DataFileSpec],
    schema: RowSchema | None = None,
    *,
    shuffle_buffer: int = 1024,
    seed: int = 0,
    epochs: int | None = 1,
    batch_rows: int = 256,
) -> DataStream:
    """Open every file and stream them as one mix.

    Args:
        files: Paths or :class:`DataFileSpec` (with weights); unweighted files are weighed by row count.
            Mixing weighted and unweighted files is an error.
        schema: Column names and row rules.
        shuffle_buffer: Rows held for shuffling.
        seed: Seeds mixing and shuffling.
        epochs: Passes over each file (None: endless).
        batch_rows: Rows decoded at a time per file.

    Raises:
        DataFileError: A file does not exist, cannot be read or lacks a required column (named).
        ValueError: No files, or only some of them weighted.
    """
    specs = [f if isinstance(f, DataFileSpec) else DataFileSpec(path=os.fspath(f)) for f in files]
    if not specs:
        raise ValueError("no dataset files given")
    weighted = [s.weight is not None for s in specs]
    if any(weighted) and not all(weighted):
        raise ValueError("give a weight to every dataset file or to none of them")
    schema = schema or RowSchema()
    wanted = schema_columns(schema)  # columns the schema never reads are not decoded
    sources = [open_source(s.path, format=s.format, batch_rows=batch_rows, columns=wanted) for s in specs]
    weights = [float(s.weight) for s in specs if s.weight is not None] if all(weighted) else None
    return DataStream(sources, schema, weights=weights, shuffle_buffer=shuffle_buffer, seed=seed, epochs=epochs)
