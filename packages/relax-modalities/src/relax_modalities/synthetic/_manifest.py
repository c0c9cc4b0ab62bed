"""Manifest items (one JSON object per line) and their reader/writer."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from relax_modalities._errors import MediaError

MediaKind = Literal["image", "audio", "video"]
"""The modalities of the synthetic tasks' items."""


@dataclass(frozen=True)
class MediaRef:
    """One media file of an item.

    Attributes:
        modality: a registered modality's name (``"image"``, ``"audio"``, ``"video"``, ...; `MODALITY_PATHS`).
        path: absolute path (the manifest stores it relative to its own directory).
        audio_track: for a video, also extract its audio track as a separate audio input.
    """

    modality: str
    path: str
    audio_track: bool = False


@dataclass(frozen=True)
class TaskItem:
    """One prompt with its media, answer and grading information.

    Attributes:
        id: unique id (``"<task>-<index>"`` for synthetic items).
        task: task name (``"image"``, ``"audio"``, ``"video"``, ``"text"``, ``"audio_video"``).
        prompt: user text, only characters of the tiny vocabulary.
        media: media files, rendered before the text in this order.
        answer: the correct response (1–3 characters).
        options: every valid response.
        chance: probability that a uniform guess over ``options`` is right.
        difficulty: generator difficulty level.
    """

    id: str
    task: str
    prompt: str
    media: tuple[MediaRef, ...] = ()
    answer: str = ""
    options: tuple[str, ...] = ()
    chance: float = 0.0
    difficulty: int = 0
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def to_json(self, root: Path) -> str:
        """One manifest line; media paths relative to ``root``."""
        d = asdict(self)
        d["media"] = [{**asdict(m), "path": os.path.relpath(m.path, root)} for m in self.media]
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str, root: Path) -> TaskItem:
        """Parse a manifest line; relative media paths resolve against ``root``."""
        d = json.loads(line)
        media = tuple(
            MediaRef(m["modality"], str(root / m["path"]), bool(m.get("audio_track", False)))
            for m in d.get("media", [])
        )
        return cls(
            id=str(d["id"]),
            task=str(d["task"]),
            prompt=str(d["prompt"]),
            media=media,
            answer=str(d.get("answer", "")),
            options=tuple(d.get("options", ())),
            chance=float(d.get("chance", 0.0)),
            difficulty=int(d.get("difficulty", 0)),
            meta=dict(d.get("meta", {})),
        )


def write_manifest(items: Sequence[TaskItem], path: str | os.PathLike[str]) -> Path:
    """Write items as JSONL (atomically: temp file, then rename); return the path."""
    p = Path(path)
    tmp = p.with_suffix(p.suffix + ".tmp")
    root = p.parent.resolve()
    with tmp.open("w", encoding="utf-8") as f:
        for item in items:
            f.write(item.to_json(root) + "\n")
    tmp.replace(p)
    return p


def iter_manifest(path: str | os.PathLike[str]) -> Iterator[TaskItem]:
    """Yield the items of a JSONL manifest.

    Raises:
        MediaError: (modality ``"manifest"``) for a line that is not a valid item, naming the line.
    """
    p = Path(path)
    root = p.parent.resolve()
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield TaskItem.from_json(line, root)
            except (ValueError, KeyError, TypeError) as exc:
                raise MediaError(p, "manifest", f"line {lineno}: {type(exc).__name__}: {exc}") from exc


def read_manifest(path: str | os.PathLike[str]) -> list[TaskItem]:
    """All items of a JSONL manifest (see `iter_manifest`)."""
    return list(iter_manifest(path))
