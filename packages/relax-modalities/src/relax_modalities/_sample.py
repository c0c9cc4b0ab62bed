"""One prompt → the kwargs Qwen2.5-Omni's thinker forward takes."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from relax_modalities._audio_io import AudioSettings
from relax_modalities._errors import MediaError
from relax_modalities._image import ImageSettings
from relax_modalities._media import MediaBundle
from relax_modalities._modality import MODALITY_PATHS, bundle_inputs, modality_path
from relax_modalities._paths import (  # re-exported: they were defined here before the modality paths
    audio_features_from_blocks,
    audio_features_from_waveform,
    audio_in_video_chunks,
    pad_audio_features,
)
from relax_modalities._record import record_media_refs, record_messages
from relax_modalities._rows import DataRecord, MediaItem
from relax_modalities._video import VideoSettings
from relax_modalities.synthetic._manifest import MediaRef, TaskItem
from relax_modalities.text import (
    TINY_TEMPLATE,
    ChatBuilder,
    ChatTemplate,
    CheckpointTemplate,
    TemplateChat,
    Tokenizer,
)

__all__ = [
    "ProcessorSettings",
    "SampleProcessor",
    "audio_features_from_blocks",
    "audio_features_from_waveform",
    "audio_in_video_chunks",
    "pad_audio_features",
    "process_sample",
]


_T = TypeVar("_T")


@dataclass(frozen=True, init=False)
class ProcessorSettings:
    """Settings of every registered modality path plus the chat template.

    Each modality's settings are its own type, declared by its path (`ModalityPath.default_settings`) and given by
    its name: ``ProcessorSettings(image=ImageSettings(max_pixels=...), points=PointsSettings(...))``. A modality
    given none uses its path's defaults, so registering a modality needs no change here. `of` reads them
    (``image`` / ``video`` / ``audio`` are shorthands for the built-in three).

    Attributes:
        modalities: ``(name, settings)`` of every modality registered at construction, in registry order (its
            path's defaults where none were given).
        template: how prompts are rendered: a `CheckpointTemplate` renders with the tokenizer's own chat
            template (the checkpoint's placeholder ids given); a `ChatTemplate` renders fixed strings (the
            standalone tiny vocabulary's by default, `ChatTemplate.qwen()` for Qwen's tokenizers).
        system: optional system message (only for templates with a system turn).
        use_audio_in_video: render a video's sound track (``audio_track=True``) interleaved with its
            frames in time chunks, as Qwen2.5-Omni's ``use_audio_in_video``; pass the same flag to
            the thinker's forward. Otherwise the track is a separate audio span after the video.
        position_id_per_seconds: the thinker config's ``position_id_per_seconds`` (temporal
            rope positions per second).
        seconds_per_chunk: the thinker config's ``seconds_per_chunk`` (interleaving chunk length).
    """

    modalities: tuple[tuple[str, object], ...]
    template: ChatTemplate | CheckpointTemplate
    system: str | None
    use_audio_in_video: bool
    position_id_per_seconds: int
    seconds_per_chunk: float

    def __init__(
        self,
        *,
        template: ChatTemplate | CheckpointTemplate = TINY_TEMPLATE,
        system: str | None = None,
        use_audio_in_video: bool = False,
        position_id_per_seconds: int = 25,
        seconds_per_chunk: float = 2.0,
        modalities: Mapping[str, object] | Iterable[tuple[str, object]] = (),
        **per_modality: object,
    ) -> None:
        """Args: the attributes above; ``per_modality`` and ``modalities`` map a registered modality's name to its
        settings (``per_modality`` wins; `dataclasses.replace` passes both).

        Raises:
            TypeError: a name that is no registered modality, or settings not of its path's type (named).
        """
        given = {**dict(modalities.items() if isinstance(modalities, Mapping) else modalities), **per_modality}
        for name, value in given.items():
            if name not in MODALITY_PATHS:
                registered = ", ".join(MODALITY_PATHS)
                raise TypeError(f"ProcessorSettings: {name!r} is not a registered modality (registered: {registered})")
            want = type(MODALITY_PATHS[name].default_settings)
            if not isinstance(value, want):
                raise TypeError(f"ProcessorSettings({name}=...): expected {want.__name__}, got {type(value).__name__}")
        # Every registered modality's entry, defaults filled in: equal settings compare equal however given.
        ordered = tuple((n, given.get(n, path.default_settings)) for n, path in MODALITY_PATHS.items())
        for attr, value in (
            ("modalities", ordered),
            ("template", template),
            ("system", system),
            ("use_audio_in_video", use_audio_in_video),
            ("position_id_per_seconds", position_id_per_seconds),
            ("seconds_per_chunk", seconds_per_chunk),
        ):
            object.__setattr__(self, attr, value)  # frozen: the generated __setattr__ refuses

    def of(self, name: str, kind: type[_T]) -> _T:
        """The settings of modality ``name`` (its path's defaults for one registered after construction).

        Raises:
            KeyError: ``name`` is no registered modality.
            TypeError: its settings are not a ``kind``.
        """
        value = dict(self.modalities).get(name)
        if value is None:
            value = modality_path(name, "ProcessorSettings.of").default_settings
        if not isinstance(value, kind):
            raise TypeError(f"ProcessorSettings.of({name!r}): settings are {type(value).__name__}, not {kind.__name__}")
        return value

    def with_modality(self, name: str, settings: object) -> ProcessorSettings:
        """A copy with modality ``name``'s settings replaced (checked as the constructor checks them)."""
        return replace(self, modalities=(*((n, v) for n, v in self.modalities if n != name), (name, settings)))

    @property
    def image(self) -> ImageSettings:
        """The image path's settings."""
        return self.of("image", ImageSettings)

    @property
    def video(self) -> VideoSettings:
        """The video path's settings."""
        return self.of("video", VideoSettings)

    @property
    def audio(self) -> AudioSettings:
        """The audio path's settings."""
        return self.of("audio", AudioSettings)


def _as_item(item: TaskItem | Mapping[str, Any]) -> TaskItem:
    if isinstance(item, TaskItem):
        return item
    media = tuple(
        MediaRef(m["modality"], str(m["path"]), bool(m.get("audio_track", False))) for m in item.get("media", ())
    )
    return TaskItem(id=str(item.get("id", "")), task=str(item.get("task", "")), prompt=str(item["prompt"]), media=media)


class SampleProcessor:
    """Turns manifest items into thinker kwargs; holds the tokenizer, settings and chat builder.

    Args:
        tokenizer: a `Tokenizer` (a checkpoint's ``AutoTokenizer``, or `TinyTokenizer`).
        settings: modality and template settings.
    """

    def __init__(self, tokenizer: Tokenizer, settings: ProcessorSettings | None = None) -> None:
        self.settings = settings or ProcessorSettings()
        template = self.settings.template
        self.builder: ChatBuilder | TemplateChat = (
            TemplateChat(tokenizer, template, modalities=tuple(MODALITY_PATHS))  # type: ignore[arg-type]
            if isinstance(template, CheckpointTemplate)
            else ChatBuilder(tokenizer, template)
        )

    def __call__(self, item: TaskItem | Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Process one item; see `process_sample` for the returned keys.

        Raises:
            MediaError: for any media file that cannot be processed.
        """
        it = _as_item(item)
        media = MediaBundle()
        for ref in it.media:
            if ref.modality not in MODALITY_PATHS:
                raise MediaError(ref.path, "manifest", f"unknown media modality {ref.modality!r} in item {it.id!r}")
            self._add_checked(ref, media)
        prompt = self.builder.build(it.prompt, media.slots, system=self.settings.system)
        return bundle_inputs(media, prompt.input_ids)

    def process_record(self, record: DataRecord, inline_dir: Path | None = None) -> dict[str, torch.Tensor]:
        """Process one dataset record (:func:`~relax_modalities.build_stream`'s): its whole chat rendered with
        the checkpoint's chat template, each media placeholder where the row put it. Returns the keys of
        `process_sample`.

        Args:
            record: The record.
            inline_dir: Where inline media bytes are written as files (named by content) before decoding.

        Raises:
            MediaError: for any media item that cannot be processed.
            ValueError: a chat the plain-string template cannot render (more than one user turn, or media
                after text): use a checkpoint template.
        """
        media = MediaBundle()
        kinds: list[list[str]] = []
        for ref in record_media_refs(record, inline_dir):
            before = len(media.slots)
            self._add_checked(ref, media)
            kinds.append([slot.modality for slot in media.slots[before:]])
        if isinstance(self.builder, TemplateChat):
            prompt = self.builder.render(record_messages(record, kinds), media.slots)
        else:
            prompt = self.builder.build(_single_turn_text(record), media.slots, system=self.settings.system)
        return bundle_inputs(media, prompt.input_ids)

    def process_media(self, items: Sequence[MediaItem], inline_dir: Path | None = None) -> MediaBundle:
        """Process media items outside a prompt, in order, as `process_record` processes a row's items (inline
        bytes written to ``inline_dir`` first): a multi-turn episode's environment returns media between turns,
        whose slots are then expanded into the turn's rendered ids with `TemplateChat.expand`.

        Raises:
            MediaError: for any media item that cannot be processed (an unregistered modality among them).
        """
        media = MediaBundle()
        for ref in record_media_refs(DataRecord(source="", row=-1, messages=(), media=tuple(items)), inline_dir):
            if ref.modality not in MODALITY_PATHS:
                raise MediaError(ref.path, "manifest", f"unknown media modality {ref.modality!r}")
            self._add_checked(ref, media)
        return media

    def _add_checked(self, ref: MediaRef, media: MediaBundle) -> None:
        try:
            self._add(ref, media)
        except MediaError:
            raise
        except Exception as exc:  # any other failure on this file is still this file's error
            raise MediaError(ref.path, ref.modality, f"{type(exc).__name__}: {exc}") from exc

    def _add(self, ref: MediaRef, media: MediaBundle) -> None:
        MODALITY_PATHS[ref.modality].process(ref, self.settings, media)


def _single_turn_text(record: DataRecord) -> str:
    """The text of a one-user-turn record whose media all come before its text (what `ChatBuilder` renders)."""
    if len(record.messages) != 1 or record.messages[0].role != "user":
        raise ValueError(f"record {record.uid}: a plain-string chat template renders one user turn only")
    parts = record.messages[0].parts
    first_text = next((i for i, p in enumerate(parts) if p.type == "text"), len(parts))
    if any(p.type != "text" for p in parts[first_text:]):
        raise ValueError(f"record {record.uid}: a plain-string chat template renders media before the text only")
    return "".join(p.text for p in parts)


def process_sample(
    item: TaskItem | Mapping[str, Any], tokenizer: Tokenizer, settings: ProcessorSettings | None = None
) -> dict[str, torch.Tensor]:
    """The exact kwargs ``Qwen2_5OmniThinkerForConditionalGeneration.forward`` takes for one prompt.

    Keys (media keys only when the item has that modality):

    - ``input_ids`` ``[1, T]`` int64 and ``attention_mask`` ``[1, T]`` int64 (all ones);
    - ``pixel_values`` ``[sum patches, 3*tp*p*p]`` float32 and ``image_grid_thw`` ``[n_img, 3]`` int64;
    - ``pixel_values_videos`` ``[sum patches, 3*tp*p*p]``, ``video_grid_thw`` ``[n_vid, 3]`` and
      ``video_second_per_grid`` ``[n_vid]`` float32;
    - ``input_features`` ``[n_aud, 128, L]`` float32 and ``feature_attention_mask`` ``[n_aud, L]`` int64
      (a video with ``audio_track=True`` adds its track as an audio item right after the video).

    Args:
        item: a `TaskItem` or a mapping with ``prompt`` and ``media`` (``[{"modality", "path"}]``).
        tokenizer: a `Tokenizer`.
        settings: modality settings; build a `SampleProcessor` once when processing many items.

    Raises:
        MediaError: for a media file that cannot be processed.
    """
    return SampleProcessor(tokenizer, settings)(item)
