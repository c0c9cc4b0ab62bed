"""A dataset record's chat and media in the form the sample processor takes: typed chat messages for the
checkpoint's chat template, and one file path per media item (inline bytes written to a file first)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relax_modalities._errors import MediaError
from relax_modalities._rows import DataRecord, MediaItem
from relax_modalities.synthetic._manifest import MediaRef

__all__ = ["materialise_media", "record_media_refs", "record_messages"]

# File signatures of the common encodings: the decoders read the content, but a suffix keeps the files
# recognisable to a person looking into the folder.
_MAGIC: tuple[tuple[bytes, int, str], ...] = (
    (b"\x89PNG", 0, ".png"),
    (b"\xff\xd8\xff", 0, ".jpg"),
    (b"GIF8", 0, ".gif"),
    (b"WEBP", 8, ".webp"),
    (b"WAVE", 8, ".wav"),
    (b"fLaC", 0, ".flac"),
    (b"OggS", 0, ".ogg"),
    (b"ftyp", 4, ".mp4"),
    (b"\x1aE\xdf\xa3", 0, ".mkv"),
)


def _suffix(data: bytes) -> str:
    for magic, at, suffix in _MAGIC:
        if data[at : at + len(magic)] == magic:
            return suffix
    return ".bin"


def materialise_media(item: MediaItem, folder: Path | None) -> str:
    """The path of ``item``: its own, or for inline bytes a file in ``folder`` named by the bytes' SHA-256
    (written once; the same bytes in many rows share one file).

    Raises:
        MediaError: inline bytes and no ``folder`` to write them to.
    """
    if item.path is not None:
        return item.path
    assert item.data is not None
    digest = hashlib.sha256(item.data).hexdigest()[:32]
    if folder is None:
        raise MediaError(f"<inline {item.kind} {digest}>", item.kind, "inline bytes need a folder to be written to")
    path = folder / f"{digest}{_suffix(item.data)}"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_bytes(item.data)
        tmp.replace(path)  # atomic: a concurrent reader never sees a half-written file
    return str(path)


def record_media_refs(record: DataRecord, folder: Path | None) -> list[MediaRef]:
    """One :class:`MediaRef` per media item of ``record``, in placeholder order (a video item's
    ``audio_track`` key, as the synthetic dataset writes it, asks for its sound track too)."""
    return [
        MediaRef(m.kind, materialise_media(m, folder), bool(m.meta.get("audio_track", False))) for m in record.media
    ]


def record_messages(record: DataRecord, slot_kinds: Sequence[Sequence[str]]) -> list[dict[str, Any]]:
    """The record's chat as chat-template messages: a message with media has typed content parts (one
    ``{"type": kind}`` per slot its item produced, ``slot_kinds[j]`` for the ``j``-th item), a text-only
    message keeps its content a string."""
    out: list[dict[str, Any]] = []
    j = 0
    for message in record.messages:
        if all(p.type == "text" for p in message.parts):
            out.append({"role": message.role, "content": message.text})
            continue
        content: list[dict[str, str]] = []
        for part in message.parts:
            if part.type == "text":
                content.append({"type": "text", "text": part.text})
            else:
                content += [{"type": kind} for kind in slot_kinds[j]]
                j += 1
        out.append({"role": message.role, "content": content})
    return out
