"""The dataset row schema (compatible with verl's RL parquet) and its parser into one typed record.

A row is a mapping of column names to values, as JSONL, Parquet and Hugging Face ``datasets`` all yield
it. :func:`parse_row` turns one into a :class:`DataRecord` or raises :class:`BadRow` naming the reason;
the stream counts bad rows and goes on.

The media columns and prompt markers come from the modality registry (`MODALITY_PATHS`): each registered modality
has a column (the schema's ``media_keys`` entry, else its path's `ModalityPath.column`) and a ``<name>`` marker,
so a registered modality is read from dataset files with no change here (:func:`media_columns`).
"""

from __future__ import annotations

import functools
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax_core import RewardRequest, RowSchema  # RowSchema lives in relax-core: run configs load it without torch

BUILTIN_COLUMNS: dict[str, str] = {"image": "images", "video": "videos", "audio": "audios"}
"""The built-in modalities' dataset columns, as their paths declare them (``ImagePath.column``, ...; a test keeps
the two equal), in registry order."""


def _registered_columns() -> dict[str, str]:
    """Name → declared column of every registered modality, in registry order.

    The registry (`MODALITY_PATHS`) lives with the media paths, which import numpy and torch; a process that only
    streams records must not load them. Registering a modality imports the registry, so when it is not loaded no
    modality beyond the built-ins can be registered, and their declared columns stand in.
    """
    registry = sys.modules.get("relax_modalities._modality")
    if registry is None:
        return dict(BUILTIN_COLUMNS)
    return {name: path.column for name, path in registry.MODALITY_PATHS.items()}


__all__ = [
    "BadRow",
    "ChatMessage",
    "ContentPart",
    "DataRecord",
    "MediaItem",
    "RowSchema",
    "media_columns",
    "parse_row",
]

MediaKind = str
"""A registered modality's name (a key of `MODALITY_PATHS`)."""


@functools.lru_cache(maxsize=8)
def _marker(names: tuple[str, ...]) -> re.Pattern[str]:
    # verl writes "<image>" / "<video>" into the prompt text where the item goes; every modality likewise.
    return re.compile("<(" + "|".join(re.escape(n) for n in names) + ")>")


def media_columns(schema: RowSchema) -> dict[str, str]:
    """Modality name → the column of its items, for every registered modality, in registry order.

    Raises:
        ValueError: ``schema.media_keys`` names a modality that is not registered, or two modalities (or a
            modality and the prompt) read one column; the message names the keys.
    """
    declared = _registered_columns()
    unknown = sorted(set(schema.media_keys) - set(declared))
    if unknown:
        registered = ", ".join(declared)
        raise ValueError(f"schema.media_keys: {unknown} not registered modalities (registered: {registered})")
    columns: dict[str, str] = {}
    for name, own_column in declared.items():
        column = schema.media_key(name) or own_column
        clash = next((n for n, c in columns.items() if c == column), None)
        if clash is not None or column == schema.prompt_key:
            other = f"modality {clash!r}" if clash is not None else "prompt_key"
            raise ValueError(f"schema: modality {name!r} and {other} both read column {column!r}")
        columns[name] = column
    return columns


class BadRow(ValueError):
    """A row that cannot become a record; the stream skips and counts it.

    Attributes:
        reason: What was wrong, naming the column (``"column 'prompt': missing"``).
    """

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


@dataclass(frozen=True)
class MediaItem:
    """One media input of a prompt (an image, video, audio clip or an item of another registered modality).

    Attributes:
        kind: Its modality's name (``image``, ``video``, ``audio``, ...).
        path: Absolute path of the file, None when the item is inline bytes.
        data: The encoded file's bytes, None when the item is a path.
        meta: Other keys of a dict item (verl video items carry ``fps``, ``nframes``, ...).
    """

    kind: MediaKind
    path: str | None = None
    data: bytes | None = field(default=None, repr=False)
    meta: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class ContentPart:
    """One piece of a chat message: text, or the placeholder of the ``index``-th media item of its kind."""

    type: str  # "text" or a registered modality's name
    text: str = ""
    index: int = -1


@dataclass(frozen=True)
class ChatMessage:
    """One chat turn, its content split into text and media placeholders."""

    role: str
    parts: tuple[ContentPart, ...]

    @property
    def text(self) -> str:
        """The content with each media item written back as its ``<kind>`` marker."""
        return "".join(p.text if p.type == "text" else f"<{p.type}>" for p in self.parts)


@dataclass(frozen=True)
class DataRecord:
    """One prompt of a dataset file, parsed and checked.

    Attributes:
        source: The file (or dataset folder) it came from.
        row: Its row index in that source (0-based; for JSONL the line index).
        messages: The chat prompt.
        media: Every media item, in the order the placeholders appear in ``messages``.
        data_source: The dataset it belongs to (routes the reward).
        ground_truth: What the reward compares against (None when the schema does not require one).
        extra_info: Free-form metadata for the reward.
        epoch: Which pass over its source produced it (0 first).
    """

    source: str
    row: int
    messages: tuple[ChatMessage, ...]
    media: tuple[MediaItem, ...] = ()
    data_source: str = ""
    ground_truth: Any = None
    extra_info: dict[str, Any] = field(default_factory=dict, compare=False)
    epoch: int = 0

    @property
    def uid(self) -> str:
        """``"<source>:<row>"``: unique within a run's files, the same in every epoch."""
        return f"{self.source}:{self.row}"

    def reward_request(self, response: str) -> RewardRequest:
        """What relax-core's reward runner needs to score ``response`` to this prompt."""
        return RewardRequest(response, self.ground_truth, self.data_source, dict(self.extra_info))

    def media_of(self, kind: MediaKind) -> tuple[MediaItem, ...]:
        """The items of one kind, indexed as the placeholders' ``index`` counts them."""
        return tuple(m for m in self.media if m.kind == kind)


def schema_columns(schema: RowSchema) -> tuple[str, ...]:
    """Every column the schema reads (a reader may skip decoding the others)."""
    return (
        schema.prompt_key,
        *media_columns(schema).values(),
        schema.data_source_key,
        schema.reward_key,
        schema.answer_key,
        schema.extra_info_key,
    )


def required_columns(schema: RowSchema) -> tuple[tuple[str, ...], ...]:
    """Column alternatives a file must have: the prompt, and (when required) one ground-truth column."""
    needed: list[tuple[str, ...]] = [(schema.prompt_key,)]
    if schema.require_ground_truth:
        needed.append((schema.reward_key, schema.answer_key))
    return tuple(needed)


def parse_row(row: Mapping[str, Any], schema: RowSchema, root: Path) -> DataRecord:
    """Parse one row; ``root`` is the folder relative media paths start from.

    ``source``/``row`` of the result are left empty; the caller fills them.

    Raises:
        BadRow: A missing or mistyped field, a marker/item count mismatch, or a missing media file.
    """
    if not isinstance(row, Mapping):
        raise BadRow(f"row is a {type(row).__name__}, not a mapping of columns")
    media: dict[MediaKind, list[MediaItem]] = {}
    for kind, key in media_columns(schema).items():
        media[kind] = _media_column(row.get(key), kind, key, root, schema.check_media_files)
    messages, ordered = _prompt(row, schema.prompt_key, media, root, schema.check_media_files)
    return DataRecord(
        source="",
        row=-1,
        messages=messages,
        media=ordered,
        data_source=_data_source(row, schema),
        ground_truth=_ground_truth(row, schema),
        extra_info=_extra_info(row, schema.extra_info_key),
    )


def _data_source(row: Mapping[str, Any], schema: RowSchema) -> str:
    value = row.get(schema.data_source_key)
    if value is None:
        return schema.default_data_source
    if not isinstance(value, str):
        raise BadRow(f"column {schema.data_source_key!r}: expected a string, got {type(value).__name__}")
    return value


def _ground_truth(row: Mapping[str, Any], schema: RowSchema) -> Any:
    holder = row.get(schema.reward_key)
    if holder is not None:
        if not isinstance(holder, Mapping):
            raise BadRow(f"column {schema.reward_key!r}: expected a mapping, got {type(holder).__name__}")
        if holder.get(schema.ground_truth_key) is not None:
            return holder[schema.ground_truth_key]
    if row.get(schema.answer_key) is not None:
        return row[schema.answer_key]
    if schema.require_ground_truth:
        where = f"{schema.reward_key}.{schema.ground_truth_key}"
        raise BadRow(f"no ground truth: {where!r} and {schema.answer_key!r} are both missing or null")
    return None


def _extra_info(row: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = row.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise BadRow(f"column {key!r}: expected a mapping, got {type(value).__name__}")
    return dict(value)


def _media_column(value: Any, kind: MediaKind, key: str, root: Path, check: bool) -> list[MediaItem]:
    if value is None:
        return []
    items = value if isinstance(value, list | tuple) else [value]
    return [_media_item(item, kind, f"column {key!r} item {i}", root, check) for i, item in enumerate(items)]


def _media_item(item: Any, kind: MediaKind, where: str, root: Path, check: bool) -> MediaItem:
    meta: dict[str, Any] = {}
    if isinstance(item, Mapping):
        # Bytes win over a path: `datasets` keeps the original file name in "path" beside the bytes.
        meta = {k: v for k, v in item.items() if k not in ("bytes", "path", kind, "type") and v is not None}
        inline = item.get("bytes")
        item = inline if inline is not None else (item.get("path") or item.get(kind))
    if isinstance(item, bytes | bytearray | memoryview):
        data = bytes(item)
        if not data:
            raise BadRow(f"{where}: empty bytes")
        return MediaItem(kind, data=data, meta=meta)
    if not isinstance(item, str) or not item:
        raise BadRow(f"{where}: expected a path, bytes or a {{'bytes', 'path'}} dict, got {type(item).__name__}")
    path = item.removeprefix("file://")
    resolved = Path(path) if os.path.isabs(path) else root / path
    if check and not resolved.is_file():
        raise BadRow(f"{where}: {kind} file {str(resolved)!r} does not exist")
    return MediaItem(kind, path=str(resolved), meta=meta)


def _prompt(
    row: Mapping[str, Any], key: str, media: dict[MediaKind, list[MediaItem]], root: Path, check: bool
) -> tuple[tuple[ChatMessage, ...], tuple[MediaItem, ...]]:
    value = row.get(key)
    if value is None:
        raise BadRow(f"column {key!r}: missing or null")
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not isinstance(value, list | tuple) or not value:
        raise BadRow(f"column {key!r}: expected a non-empty list of chat messages, got {type(value).__name__}")
    used = dict.fromkeys(media, 0)
    ordered: list[MediaItem] = []
    messages = []
    for i, message in enumerate(value):
        where = f"column {key!r} message {i}"
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise BadRow(f"{where}: expected a mapping with a string 'role'")
        parts = _parts(message.get("content"), where, root, check, media, used, ordered)
        messages.append(ChatMessage(message["role"], parts))
    for kind in media:
        if used[kind] != len(media[kind]):
            raise BadRow(f"column {key!r}: {used[kind]} {kind} placeholder(s) but {len(media[kind])} {kind} item(s)")
    return tuple(messages), tuple(ordered)


def _parts(
    content: Any,
    where: str,
    root: Path,
    check: bool,
    media: dict[MediaKind, list[MediaItem]],
    used: dict[MediaKind, int],
    ordered: list[MediaItem],
) -> tuple[ContentPart, ...]:
    def place(kind: MediaKind, inline: MediaItem | None) -> ContentPart:
        if inline is not None:  # a typed part carrying its own file joins that kind's items here
            media[kind].insert(used[kind], inline)
        if used[kind] >= len(media[kind]):
            raise BadRow(f"{where}: more {kind} placeholders than {kind} items")
        ordered.append(media[kind][used[kind]])
        used[kind] += 1
        return ContentPart(kind, index=used[kind] - 1)

    if isinstance(content, str):
        out: list[ContentPart] = []
        for j, piece in enumerate(_marker(tuple(media)).split(content)):
            if j % 2 == 0:
                if piece:
                    out.append(ContentPart("text", text=piece))
            else:
                out.append(place(piece, None))  # the regex only captures registered names
        return tuple(out)
    if not isinstance(content, list | tuple):
        raise BadRow(f"{where}: 'content' must be a string or a list of typed parts, got {type(content).__name__}")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise BadRow(f"{where} part {j}: a text part needs a string 'text'")
            out.append(ContentPart("text", text=text))
        elif isinstance(kind, str) and kind in media:
            has_own = any(part.get(k) is not None for k in (kind, "path", "bytes"))
            inline = _media_item(part, kind, f"{where} part {j}", root, check) if has_own else None
            out.append(place(kind, inline))
        else:
            raise BadRow(f"{where} part {j}: 'type' must be text or a registered modality ({', '.join(media)})")
    return tuple(out)
