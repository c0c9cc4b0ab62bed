"""What an evaluation keeps of its conversations for the run's samples files: the prompt and response text, the
reward, and each prompt's media (a small thumbnail for an image, the file's path otherwise)."""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["EvalSample", "MediaLink", "image_thumbnail", "media_links", "prompt_text"]

THUMBNAIL_PX = 96
"""Longest side of an image thumbnail, in pixels."""

_REPEATS = re.compile(r"(<\|[^<>|]+\|>|<[a-z_]+>)\1+")


class MediaLink(TypedDict):
    """One media input of a sample: its modality, the file it was read from, and for an image a PNG thumbnail
    (``data:image/png;base64,...``; None when the file could not be read)."""

    kind: str
    path: str
    thumbnail: str | None


class EvalSample(TypedDict):
    """One evaluated conversation: the task, the prompt as the model saw it (media placeholders collapsed), the
    greedy response, its reward and the media of its prompt."""

    task: str
    prompt: str
    response: str
    reward: float
    media: list[MediaLink]


def prompt_text(input_ids: Sequence[int], tokenizer: PreTrainedTokenizerBase) -> str:
    """The prompt's text with special tokens kept, a run of one repeated placeholder (an image's patches) as one
    ``<placeholder>×count``."""
    text = str(tokenizer.decode(list(input_ids), skip_special_tokens=False))
    return _REPEATS.sub(lambda m: f"{m.group(1)}×{len(m.group(0)) // len(m.group(1))}", text)


def image_thumbnail(path: str, size: int = THUMBNAIL_PX) -> str | None:
    """A PNG data URI of the image at ``path`` fitted into ``size``×``size`` pixels; None when it cannot be read."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            small = ImageOps.exif_transpose(image).convert("RGB")
            small.thumbnail((size, size))
    except (OSError, UnidentifiedImageError, ValueError):
        return None
    buffer = io.BytesIO()
    small.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def media_links(media: Sequence[tuple[str, str | None]]) -> list[MediaLink]:
    """``(kind, path)`` of a prompt's media → its links (an item given as inline bytes has no path and is left out);
    thumbnails for images."""
    return [
        MediaLink(kind=kind, path=path, thumbnail=image_thumbnail(path) if kind == "image" else None)
        for kind, path in media
        if path is not None
    ]
