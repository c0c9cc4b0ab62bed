"""The one error type every data path raises for bad input."""

from __future__ import annotations

import os
from pathlib import Path

MediaModality = str
"""Which data path rejected a file: a registered modality's name (``image``, ``audio``, ``video``, ...), ``text``
or ``manifest`` (the item or row that names the file)."""


class MediaError(Exception):
    """A media file that cannot be turned into model input.

    Raised for truncated, corrupt, zero-length, wrong-format or oversized (decompression bomb) files
    and for files that do not exist. The loading pipeline catches it, counts it per modality and
    reason, and skips the sample.

    Attributes:
        path: the offending file.
        modality: which data path rejected it.
        reason: short human-readable cause (``"empty file"``, ``"decompression bomb: ..."``).
    """

    def __init__(self, path: str | os.PathLike[str], modality: MediaModality, reason: str) -> None:
        self.path = str(path)
        self.modality = modality
        self.reason = reason
        super().__init__(f"{modality} file {self.path!r}: {reason}")

    def __reduce__(self) -> tuple[type[MediaError], tuple[str, MediaModality, str]]:
        # Keep the three fields through pickling (worker threads/processes re-raise it).
        return (type(self), (self.path, self.modality, self.reason))


def check_readable(path: str | os.PathLike[str], modality: MediaModality) -> Path:
    """Raise `MediaError` when ``path`` is missing, not a regular file or empty; return it as a `Path`."""
    p = Path(path)
    if not p.exists():
        raise MediaError(p, modality, "file does not exist")
    if not p.is_file():
        raise MediaError(p, modality, "not a regular file")
    if p.stat().st_size == 0:
        raise MediaError(p, modality, "empty file (zero bytes)")
    return p
