"""Dataset sources: JSONL, Parquet and Hugging Face ``datasets``, each read as a stream of rows.

Every source satisfies :class:`RowSource`: it knows its row count and column names at open and yields
``(row_index, row)`` from any start row without holding more than one batch in memory. A file that does
not exist, cannot be read or lacks the required columns raises :class:`DataFileError` at open.
"""

from __future__ import annotations

import json
import os
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "DataFileError",
    "HFDatasetSource",
    "JsonlSource",
    "ParquetSource",
    "RowSource",
    "open_source",
]

_JSONL_INDEX_EVERY = 1024  # one byte offset kept per this many lines: resume seeks, memory stays flat


class DataFileError(ValueError):
    """A dataset file that cannot be used at all (missing, unreadable, or without the required columns).

    Attributes:
        path: The offending file or folder.
        reason: What is wrong with it.
    """

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"dataset {self.path!r}: {reason}")


@runtime_checkable
class RowSource(Protocol):
    """A table of rows read as a stream.

    A row is a mapping of column name to plain Python values (lists, dicts, str, bytes, numbers) or, for a
    row that cannot even be decoded (a JSONL line that is not JSON), a string saying why.
    """

    @property
    def name(self) -> str:
        """The file or folder, as given (used in messages, counts and record uids)."""
        ...

    @property
    def root(self) -> Path:
        """The folder that relative media paths in the rows start from."""
        ...

    @property
    def columns(self) -> frozenset[str]:
        """Column names (for JSONL, the keys of the first row)."""
        ...

    def __len__(self) -> int:
        """Number of rows."""
        ...

    def iter_rows(self, start: int = 0) -> Iterator[tuple[int, Mapping[str, Any] | str]]:
        """Rows ``start, start + 1, ...`` to the end, each with its index."""
        ...


def _check_file(path: Path) -> None:
    if not path.exists():
        raise DataFileError(path, "does not exist")
    if not path.is_file():
        raise DataFileError(path, "is not a file")


class JsonlSource:
    """A JSON Lines file: one JSON object per line; blank lines are not rows.

    Opening scans the file once (counting lines and keeping one byte offset per 1,024 lines), so a start
    row is reached by a seek plus at most 1,023 skipped lines.

    Args:
        path: The ``.jsonl`` file.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = Path(path)
        _check_file(self._path)
        self._offsets = array("q")
        self._rows = 0
        first: Mapping[str, Any] | None = None
        with self._path.open("rb") as f:
            offset = 0
            for line in f:
                if self._rows % _JSONL_INDEX_EVERY == 0:
                    self._offsets.append(offset)
                offset += len(line)
                self._rows += 1
                if first is None and line.strip():
                    decoded = _decode_line(line)
                    first = decoded if isinstance(decoded, Mapping) else None
        if first is None:
            hint = "; a JSON array file reads with format='hf_json'" if self._path.suffix == ".json" else ""
            raise DataFileError(self._path, f"has no line holding a JSON object (JSON Lines expected){hint}")
        self._columns = frozenset(first)

    @property
    def name(self) -> str:
        return str(self._path)

    @property
    def root(self) -> Path:
        return self._path.parent

    @property
    def columns(self) -> frozenset[str]:
        return self._columns

    def __len__(self) -> int:
        return self._rows

    def iter_rows(self, start: int = 0) -> Iterator[tuple[int, Mapping[str, Any] | str]]:
        if start >= self._rows:
            return
        block = start // _JSONL_INDEX_EVERY
        with self._path.open("rb") as f:
            f.seek(self._offsets[block])
            for index, line in enumerate(f, block * _JSONL_INDEX_EVERY):
                if index >= start and line.strip():
                    yield index, _decode_line(line)


def _decode_line(line: bytes) -> Mapping[str, Any] | str:
    try:
        value = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return f"not valid JSON: {exc}"
    return value if isinstance(value, Mapping) else f"a JSON {type(value).__name__}, not an object"


class ParquetSource:
    """A Parquet file read one record batch at a time (pyarrow), never whole.

    Args:
        path: The ``.parquet`` file.
        batch_rows: Rows decoded at a time; lower it for rows with large inline media.
        columns: Read only these columns (None: all); the others are never decoded.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, batch_rows: int = 256, columns: Sequence[str] | None = None
    ) -> None:
        import pyarrow.parquet as pq

        self._path = Path(path)
        _check_file(self._path)
        try:
            # pre_buffer=False: do not read a whole row group's column chunks ahead (a verl file may be one
            # multi-GB row group); buffer_size streams pages instead.
            self._file = pq.ParquetFile(self._path, pre_buffer=False, buffer_size=1 << 20)
        except Exception as exc:
            raise DataFileError(self._path, f"is not a readable parquet file: {exc}") from exc
        meta = self._file.metadata
        self._group_starts = [0]
        for g in range(meta.num_row_groups):
            self._group_starts.append(self._group_starts[-1] + meta.row_group(g).num_rows)
        names = frozenset(self._file.schema_arrow.names)
        self._read_columns = None if columns is None else [c for c in columns if c in names]
        self._columns = names if columns is None else names & frozenset(columns)
        self._batch_rows = batch_rows

    @property
    def name(self) -> str:
        return str(self._path)

    @property
    def root(self) -> Path:
        return self._path.parent

    @property
    def columns(self) -> frozenset[str]:
        return self._columns

    def __len__(self) -> int:
        return self._group_starts[-1]

    def iter_rows(self, start: int = 0) -> Iterator[tuple[int, Mapping[str, Any] | str]]:
        if start >= len(self):
            return
        group = next(g for g in range(len(self._group_starts) - 1) if self._group_starts[g + 1] > start)
        index = self._group_starts[group]
        groups = list(range(group, len(self._group_starts) - 1))
        for batch in self._file.iter_batches(self._batch_rows, row_groups=groups, columns=self._read_columns):
            if index + batch.num_rows <= start:
                index += batch.num_rows
                continue
            skip = max(0, start - index)
            for offset, row in enumerate(batch.slice(skip).to_pylist()):
                yield index + skip + offset, row
            index += batch.num_rows


class HFDatasetSource:
    """A Hugging Face ``datasets.Dataset`` (memory-mapped Arrow), read in slices as raw Arrow rows.

    Rows come from the Arrow table, so ``Image``/``Audio`` features arrive as their stored
    ``{"bytes", "path"}`` dicts, not decoded objects. Build one with :meth:`from_disk` (a folder written by
    ``save_to_disk``) or :meth:`from_files` (``load_dataset("json" | "parquet", data_files=...)``).

    Args:
        dataset: The dataset (one split).
        name: How messages and uids name it.
        root: Folder relative media paths start from.
        batch_rows: Rows sliced at a time.
    """

    def __init__(self, dataset: Any, name: str, root: Path, *, batch_rows: int = 256) -> None:
        self._dataset = dataset.with_format("arrow")
        self._name = name
        self._root = root
        self._batch_rows = batch_rows

    @classmethod
    def from_disk(
        cls, path: str | os.PathLike[str], *, split: str | None = None, batch_rows: int = 256
    ) -> HFDatasetSource:
        """Open a ``save_to_disk`` folder; a ``DatasetDict`` folder needs ``split``."""
        import datasets

        folder = Path(path)
        if not folder.is_dir():
            raise DataFileError(folder, "does not exist" if not folder.exists() else "is not a folder")
        try:
            loaded = datasets.load_from_disk(str(folder))
        except Exception as exc:
            raise DataFileError(folder, f"is not a datasets folder: {exc}") from exc
        return cls(_one_split(loaded, split, folder), str(folder), folder, batch_rows=batch_rows)

    @classmethod
    def from_files(
        cls,
        builder: str,
        data_files: str | os.PathLike[str],
        *,
        split: str = "train",
        cache_dir: str | os.PathLike[str] | None = None,
        batch_rows: int = 256,
    ) -> HFDatasetSource:
        """``load_dataset(builder, data_files=...)`` for a local ``json`` or ``parquet`` file.

        ``datasets`` converts the file into its Arrow cache (``cache_dir``, default ``~/.cache/huggingface``)
        once; reads then map that cache.
        """
        import datasets

        if builder not in ("json", "parquet"):
            raise DataFileError(data_files, f"builder {builder!r} is not one of 'json', 'parquet'")
        path = Path(data_files)
        _check_file(path)
        try:
            loaded = datasets.load_dataset(
                builder, data_files=str(path), split=split, cache_dir=cache_dir and str(cache_dir)
            )
        except Exception as exc:
            raise DataFileError(path, f"load_dataset({builder!r}) failed: {exc}") from exc
        return cls(loaded, str(path), path.parent, batch_rows=batch_rows)

    @property
    def name(self) -> str:
        return self._name

    @property
    def root(self) -> Path:
        return self._root

    @property
    def columns(self) -> frozenset[str]:
        return frozenset(self._dataset.column_names)

    def __len__(self) -> int:
        return int(self._dataset.num_rows)

    def iter_rows(self, start: int = 0) -> Iterator[tuple[int, Mapping[str, Any] | str]]:
        for begin in range(start, len(self), self._batch_rows):
            table = self._dataset[begin : begin + self._batch_rows]  # a pyarrow.Table slice of the mapped file
            for offset, row in enumerate(table.to_pylist()):
                yield begin + offset, row


def _one_split(loaded: Any, split: str | None, where: Path) -> Any:
    import datasets

    if isinstance(loaded, datasets.DatasetDict):
        if split is None or split not in loaded:
            raise DataFileError(where, f"holds splits {sorted(loaded)}; name one with split= (got {split!r})")
        return loaded[split]
    return loaded


def open_source(
    path: str | os.PathLike[str],
    *,
    format: str = "auto",
    batch_rows: int = 256,
    columns: Sequence[str] | None = None,
) -> RowSource:
    """Open a dataset by its form: ``.jsonl``/``.json`` lines, ``.parquet``, or a ``save_to_disk`` folder.

    Args:
        path: The file or folder.
        format: ``auto`` (by suffix; a folder is a datasets folder), ``jsonl``, ``parquet``, ``hf_disk``,
            ``hf_json`` or ``hf_parquet`` (the last two through ``datasets.load_dataset``).
        batch_rows: Rows decoded at a time.
        columns: Decode only these columns of a parquet file (None: all); other formats read every column.

    Raises:
        DataFileError: The path does not exist, or its form is not known.
    """
    p = Path(path)
    if format == "auto":
        if p.is_dir():
            format = "hf_disk"
        elif p.suffix in (".jsonl", ".json", ".ndjson"):
            format = "jsonl"
        elif p.suffix in (".parquet", ".pq"):
            format = "parquet"
        elif not p.exists():
            raise DataFileError(p, "does not exist")
        else:
            raise DataFileError(p, f"unknown suffix {p.suffix!r}; give format= jsonl, parquet or hf_disk")
    openers: dict[str, Callable[[], RowSource]] = {
        "jsonl": lambda: JsonlSource(p),
        "parquet": lambda: ParquetSource(p, batch_rows=batch_rows, columns=columns),
        "hf_disk": lambda: HFDatasetSource.from_disk(p, batch_rows=batch_rows),
        "hf_json": lambda: HFDatasetSource.from_files("json", p, batch_rows=batch_rows),
        "hf_parquet": lambda: HFDatasetSource.from_files("parquet", p, batch_rows=batch_rows),
    }
    if format not in openers:
        raise DataFileError(p, f"format {format!r} is not one of auto, {', '.join(openers)}")
    return openers[format]()
