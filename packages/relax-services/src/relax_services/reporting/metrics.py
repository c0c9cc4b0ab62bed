"""Run-folder bookkeeping: metrics as JSON lines, read back for plots and summaries."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any


class MetricsWriter:
    """Appends one JSON object per line to ``metrics.jsonl``; each line is flushed at once.

    Every record carries ``kind`` (e.g. ``"train"``, ``"eval"``, ``"queue"``) and ``wall`` (seconds since the
    writer was created), so plots against wall-clock time need no other clock.
    """

    def __init__(self, path: Path, start_time: float | None = None) -> None:
        self.path = path
        self.start = time.monotonic() if start_time is None else start_time
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")

    def write(self, kind: str, record: Mapping[str, object]) -> dict[str, object]:
        """Write ``record`` tagged with ``kind`` and the wall time; return what was written."""
        row = {"kind": kind, "wall": round(time.monotonic() - self.start, 4), **record}
        self._file.write(json.dumps(row, default=_json_default) + "\n")
        self._file.flush()
        return row

    def close(self) -> None:
        """Flush and close the metrics file."""
        self._file.close()


def read_metrics(path: Path, kind: str | None = None) -> Iterator[dict[str, Any]]:
    """Yield the records of ``metrics.jsonl`` (optionally only those of one ``kind``); a torn last line is skipped."""
    with path.open(encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if kind is None or row.get("kind") == kind:
                yield row


def _json_default(value: object) -> object:
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"metrics value of type {type(value).__name__} is not JSON serialisable")
