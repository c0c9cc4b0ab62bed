"""Image, audio and video in multi-turn episodes: the media parts of an environment's or a tool's messages.

A media part has the form of a dataset row's typed part (relax-modalities' row schema): ``{"type": "image",
"image": path_or_bytes}`` (or the item under ``"path"`` / ``"bytes"``; a video part may add ``"audio_track": True``),
and likewise ``audio`` and ``video``. Each item goes through relax-modalities' own data path with the checkpoint's
processor settings (:meth:`~relax_modalities.SampleProcessor.process_media`), exactly as a dataset row's media do;
the chat template renders the part as its placeholder and :meth:`~relax_modalities.text.TemplateChat.expand` gives
it the item's token count in the turn's ids. The tensors are kept in conversation order: the engine's prompt of
every later turn and the sample's prompt (:meth:`~relax_services.agents.Episode.sample_prompt`) carry them, so the
Trainer and the Reference score the inputs the rollout saw, multimodal rope positions included.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from relax_services.agents.environment import Message

if TYPE_CHECKING:
    import torch

    from relax_modalities import MediaItem, SampleProcessor
    from relax_modalities.text import MediaSlot, PlaceholderSpan, TemplateChat
    from relax_services.models import Checkpoint

__all__ = ["EpisodeMedia", "MediaTurn", "UnsupportedMediaError", "media_kinds_of"]


class UnsupportedMediaError(ValueError):
    """An environment declares (or returns) a modality the checkpoint's family or processor cannot take; the
    message names the family and the modality."""


@dataclass
class MediaTurn:
    """The media of one turn's messages, read.

    Attributes:
        messages: The messages as the chat template renders them: each media part replaced by ``{"type": kind}``
            per slot its item fills (a video with its sound track may fill two).
        slots: The placeholder slots, in conversation order.
        media: Forward kwargs of the turn's items (``pixel_values``, ``input_features``, ...), in order.
    """

    messages: list[Message]
    slots: list[MediaSlot] = field(default_factory=list)
    media: dict[str, torch.Tensor] = field(default_factory=dict)


def _kinds() -> tuple[str, ...]:
    from relax_modalities import MODALITY_PATHS

    return tuple(MODALITY_PATHS)


def media_kinds_of(messages: Sequence[Mapping[str, object]]) -> list[str]:
    """The modality of each media part of ``messages``, in order (a part whose ``type`` is a registered
    modality's name)."""
    kinds = _kinds()
    out: list[str] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            out += [str(p["type"]) for p in content if isinstance(p, Mapping) and p.get("type") in kinds]
    return out


class EpisodeMedia:
    """Reads episode messages' media with a checkpoint's processor and expands their placeholders.

    Args:
        processor: relax-modalities' sample processor with the checkpoint's chat template and settings.
        family: The family's name (in errors).
        modalities: The modalities the family's forward takes.
        inline_dir: Where inline bytes are written as files before decoding, each read in a folder of its own that
            is removed once decoded (a temporary folder owned by this object when None, removed by :meth:`close`).

    Raises:
        ValueError: the processor renders with a plain-string template, which cannot expand a turn's ids.
    """

    def __init__(
        self, processor: SampleProcessor, family: str, modalities: Sequence[str], inline_dir: Path | None = None
    ) -> None:
        from relax_modalities.text import TemplateChat

        if not isinstance(processor.builder, TemplateChat):
            raise ValueError(f"family {family}: episode media need the checkpoint's own chat template")
        self.processor = processor
        self.chat: TemplateChat = processor.builder
        self.family = family
        self.modalities = tuple(modalities)
        self._tmp = tempfile.TemporaryDirectory(prefix="relax-episode-media-") if inline_dir is None else None
        self.inline_dir = Path(self._tmp.name) if self._tmp is not None else inline_dir

    @classmethod
    def of_checkpoint(cls, ckpt: Checkpoint, inline_dir: Path | None = None) -> EpisodeMedia:
        """The reader of ``ckpt``: its tokenizer, chat template, placeholder ids and processor settings."""
        from relax_modalities import SampleProcessor
        from relax_services.data.prompts import processor_settings

        processor = SampleProcessor(ckpt.tokenizer, processor_settings(ckpt))
        return cls(processor, ckpt.family.name, ckpt.family.modalities, inline_dir)

    def close(self) -> None:
        """Removes the temporary folder of inline bytes (when this object made it)."""
        if self._tmp is not None:
            self._tmp.cleanup()

    def check(self, kinds: Sequence[str], where: str) -> None:
        """Refuses modalities the family cannot take.

        Raises:
            UnsupportedMediaError: naming ``where``, the family and the modality.
        """
        known = _kinds()
        for kind in kinds:
            if kind not in known:
                raise UnsupportedMediaError(f"{where}: {kind!r} is not a registered modality ({', '.join(known)})")
            if kind not in self.modalities:
                raise UnsupportedMediaError(
                    f"{where}: family {self.family} cannot take {kind} (its forward takes "
                    f"{', '.join(self.modalities) or 'text only'})"
                )
            try:
                self.chat.placeholder_id(kind)
            except ValueError:
                raise UnsupportedMediaError(
                    f"{where}: family {self.family}'s checkpoint has no {kind} placeholder token"
                ) from None

    def read(self, messages: Sequence[Message], where: str) -> MediaTurn:
        """The media of ``messages`` through relax-modalities' data paths.

        Raises:
            UnsupportedMediaError: a modality the family cannot take.
            ValueError: a media part that cannot be read: not a path, bytes or a ``{"bytes", "path"}`` dict, a
                missing file, or a file the data path cannot decode (relax-modalities' ``BadRow`` and
                ``MediaError``, both ValueErrors naming the part or file and the reason).
        """
        kinds = media_kinds_of(messages)
        if not kinds:
            return MediaTurn([dict(m) for m in messages])
        self.check(kinds, where)
        from relax_modalities import MODALITY_PATHS
        from relax_services.models import join_media

        slots: list[MediaSlot] = []
        per_item: list[dict[str, torch.Tensor]] = []
        slot_kinds: list[list[str]] = []
        for i, (part, kind) in enumerate(self._parts(messages)):
            # One item at a time: its own slots are then known (a video with its sound track may add an audio one).
            # Inline bytes are written to a folder of this call, removed once decoded: a tool that makes a new image
            # every call must not fill the disk over a run.
            item = self._item(part, kind, f"{where} part {i}")
            with tempfile.TemporaryDirectory(dir=self.inline_dir) as folder:
                bundle = self.processor.process_media([item], Path(folder))
            slots += bundle.slots
            slot_kinds.append([s.modality for s in bundle.slots])
            for name, path in MODALITY_PATHS.items():
                if bundle.items.get(name):
                    per_item.append(path.model_inputs(bundle.items[name]))
        return MediaTurn(self._template_messages(messages, slot_kinds), slots, join_media(per_item))

    def expand(self, ids: Sequence[int], turn: MediaTurn) -> tuple[list[int], list[PlaceholderSpan]]:
        """``ids`` (a rendered turn) with each placeholder expanded to its slot's tokens, and each item's span in
        the result.

        Raises:
            ValueError: the template rendered another number of placeholders than the turn has slots, or in
                another order.
        """
        prompt = self.chat.expand(ids, turn.slots)
        return list(prompt.input_ids), list(prompt.spans)

    # -- parts --------------------------------------------------------------------------------------------------

    @staticmethod
    def _parts(messages: Sequence[Message]) -> list[tuple[Mapping[str, object], str]]:
        kinds = _kinds()
        out = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, list):
                out += [(p, str(p["type"])) for p in content if isinstance(p, Mapping) and p.get("type") in kinds]
        return out

    @staticmethod
    def _item(part: Mapping[str, object], kind: str, where: str) -> MediaItem:
        """The part as a dataset row's media item (relax-modalities' row parser reads it)."""
        from relax_modalities import RowSchema, parse_row

        record = parse_row(
            {"prompt": [{"role": "user", "content": [dict(part)]}]},
            RowSchema(require_ground_truth=False),
            Path.cwd(),
        )
        if len(record.media) != 1:
            raise ValueError(f"{where}: a {kind} part needs its item under {kind!r}, 'path' or 'bytes'")
        return record.media[0]

    @staticmethod
    def _template_messages(messages: Sequence[Message], slot_kinds: Sequence[Sequence[str]]) -> list[Message]:
        kinds = _kinds()
        out: list[Message] = []
        j = 0
        for message in messages:
            content = message.get("content")
            if not isinstance(content, list):
                out.append(dict(message))
                continue
            parts: list[object] = []
            for part in content:
                if isinstance(part, Mapping) and part.get("type") in kinds:
                    parts += [{"type": k} for k in slot_kinds[j]]
                    j += 1
                else:
                    parts.append(part)
            out.append({**message, "content": parts})
        return out
