"""One prompt → the kwargs Qwen2.5-Omni's thinker forward takes."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from relax_modalities._audio_io import AudioSettings, expected_num_samples, iter_audio_blocks, open_audio_track
from relax_modalities._errors import MediaError, MediaModality
from relax_modalities._image import ImageFeatures, ImageSettings, load_image, preprocess_image
from relax_modalities._mel import AudioFeatures, audio_token_count, log_mel
from relax_modalities._mel_stream import log_mel_stream
from relax_modalities._record import record_media_refs, record_messages
from relax_modalities._rows import DataRecord
from relax_modalities._video import VideoFeatures, VideoSettings, load_video
from relax_modalities.synthetic._manifest import MediaRef, TaskItem
from relax_modalities.text import (
    TINY_TEMPLATE,
    ChatBuilder,
    ChatTemplate,
    CheckpointTemplate,
    MediaSlot,
    TemplateChat,
    Tokenizer,
)


@dataclass(frozen=True)
class ProcessorSettings:
    """Settings of every modality path plus the chat template.

    Attributes:
        image: image path settings.
        audio: audio path settings.
        video: video path settings.
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

    image: ImageSettings = field(default_factory=ImageSettings)
    audio: AudioSettings = field(default_factory=AudioSettings)
    video: VideoSettings = field(default_factory=VideoSettings)
    template: ChatTemplate | CheckpointTemplate = TINY_TEMPLATE
    system: str | None = None
    use_audio_in_video: bool = False
    position_id_per_seconds: int = 25
    seconds_per_chunk: float = 2.0


def audio_in_video_chunks(
    video_grid_thw: Sequence[int],
    second_per_grid: float,
    audio_tokens: int,
    merge_size: int,
    position_id_per_seconds: int = 25,
    seconds_per_chunk: float = 2.0,
) -> tuple[tuple[int, int], ...]:
    """``(video_tokens, audio_tokens)`` per time chunk of an interleaved audio-in-video span.

    A video token's time index is ``t * second_per_grid * position_id_per_seconds`` (``t`` its
    temporal patch) and audio token ``i`` has index ``i`` (25 audio tokens per second); chunk ``j``
    holds the tokens whose index lies in ``[j, j + 1) * position_id_per_seconds * seconds_per_chunk``,
    cut exactly as Qwen2.5-Omni's processor and rope index cut them.
    """
    t, h, w = (int(x) for x in video_grid_thw)
    per_frame = (h // merge_size) * (w // merge_size)
    video_index = np.repeat(np.arange(t) * second_per_grid * position_id_per_seconds, per_frame).astype(np.int64)
    audio_index = np.arange(audio_tokens)
    per_chunk = int(position_id_per_seconds * seconds_per_chunk)
    v, a = _chunk_bounds(video_index, per_chunk), _chunk_bounds(audio_index, per_chunk)
    n = max(len(v), len(a))
    return tuple((v[j] if j < len(v) else 0, a[j] if j < len(a) else 0) for j in range(n))


def _chunk_bounds(index: np.ndarray, per_chunk: int) -> list[int]:
    # Same walk as transformers' get_chunked_index: a new chunk starts at the first token whose
    # index reaches the next multiple of `per_chunk` (one boundary per token at most).
    sizes, start, chunk = [], 0, 1
    for i, value in enumerate(index.tolist()):
        if value >= chunk * per_chunk:
            sizes.append(i - start)
            start, chunk = i, chunk + 1
    sizes.append(len(index) - start)
    return sizes


def _as_item(item: TaskItem | Mapping[str, Any]) -> TaskItem:
    if isinstance(item, TaskItem):
        return item
    media = tuple(
        MediaRef(m["modality"], str(m["path"]), bool(m.get("audio_track", False))) for m in item.get("media", ())
    )
    return TaskItem(id=str(item.get("id", "")), task=str(item.get("task", "")), prompt=str(item["prompt"]), media=media)


def audio_features_from_waveform(
    waveform: Any, settings: AudioSettings, path: str, modality: MediaModality = "audio"
) -> AudioFeatures:
    """Log-mel features and token count of a whole mono waveform (``path`` names it in errors).

    A clip under `min_audio_samples` (30 ms at 16 kHz) is zero-padded to it, as `log_mel` does.

    Raises:
        MediaError: an empty waveform or one with NaN or inf samples.
    """
    try:
        feats = log_mel(waveform, settings)  # [M, L]
    except ValueError as exc:
        raise MediaError(path, modality, str(exc)) from exc
    return AudioFeatures(feats, feats.shape[1], audio_token_count(feats.shape[1]))


def audio_features_from_blocks(
    blocks: Iterable[np.ndarray],
    settings: AudioSettings,
    path: str,
    modality: MediaModality = "audio",
    num_samples: int | None = None,
) -> AudioFeatures:
    """`audio_features_from_waveform` of streamed blocks, in memory bounded by the features (`log_mel_stream`).

    Raises:
        MediaError: from the blocks' reader, or for a stream with no samples or a NaN or inf sample.
    """
    try:
        feats = log_mel_stream(blocks, settings, num_samples=num_samples)  # [M, L]
    except ValueError as exc:
        raise MediaError(path, modality, str(exc)) from exc
    return AudioFeatures(feats, feats.shape[1], audio_token_count(feats.shape[1]))


_FILE_MODALITIES = ("image", "audio", "video")


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
            TemplateChat(tokenizer, template)  # type: ignore[arg-type]
            if isinstance(template, CheckpointTemplate)
            else ChatBuilder(tokenizer, template)
        )

    def __call__(self, item: TaskItem | Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Process one item; see `process_sample` for the returned keys.

        Raises:
            MediaError: for any media file that cannot be processed.
        """
        it = _as_item(item)
        media = _Media()
        for ref in it.media:
            if ref.modality not in _FILE_MODALITIES:
                raise MediaError(ref.path, "manifest", f"unknown media modality {ref.modality!r} in item {it.id!r}")
            self._add_checked(ref, media)
        prompt = self.builder.build(it.prompt, media.slots, system=self.settings.system)
        return media.model_inputs(prompt.input_ids)

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
        media = _Media()
        kinds: list[list[str]] = []
        for ref in record_media_refs(record, inline_dir):
            before = len(media.slots)
            self._add_checked(ref, media)
            kinds.append([slot.modality for slot in media.slots[before:]])
        if isinstance(self.builder, TemplateChat):
            prompt = self.builder.render(record_messages(record, kinds), media.slots)
        else:
            prompt = self.builder.build(_single_turn_text(record), media.slots, system=self.settings.system)
        return media.model_inputs(prompt.input_ids)

    def _add_checked(self, ref: MediaRef, media: _Media) -> None:
        try:
            self._add(ref, media)
        except MediaError:
            raise
        except Exception as exc:  # any other failure on this file is still this file's error
            modality = cast(MediaModality, ref.modality)
            raise MediaError(ref.path, modality, f"{type(exc).__name__}: {exc}") from exc

    def _add(self, ref: MediaRef, media: _Media) -> None:
        if ref.modality == "image":
            feats = preprocess_image(load_image(ref.path, self.settings.image), self.settings.image)
            media.images.append(feats)
            media.slots.append(MediaSlot("image", feats.num_tokens))
        elif ref.modality == "video":
            self._add_video(ref, media)
        else:  # audio, streamed: memory grows with the features only, not with the decoded samples
            s = self.settings.audio
            n = expected_num_samples(ref.path, s)  # header only: the features are preallocated, held once
            afeats = audio_features_from_blocks(iter_audio_blocks(ref.path, s), s, ref.path, num_samples=n)
            media.audios.append(afeats)
            media.slots.append(MediaSlot("audio", afeats.num_tokens))

    def _add_video(self, ref: MediaRef, media: _Media) -> None:
        s = self.settings
        vfeats = load_video(ref.path, s.video)
        media.videos.append(vfeats)
        if not ref.audio_track:
            media.slots.append(MediaSlot("video", vfeats.num_tokens))
            return
        track = open_audio_track(ref.path, s.audio)
        if track is None:
            raise MediaError(ref.path, "video", "audio_track requested but the file has no audio stream")
        afeats = audio_features_from_blocks(track, s.audio, ref.path)
        media.audios.append(afeats)
        if not s.use_audio_in_video:  # the track is its own audio span after the video
            media.slots += [MediaSlot("video", vfeats.num_tokens), MediaSlot("audio", afeats.num_tokens)]
            return
        chunks = audio_in_video_chunks(
            vfeats.grid_thw.tolist(),
            vfeats.second_per_grid,
            afeats.num_tokens,
            s.video.vision.merge_size,
            s.position_id_per_seconds,
            s.seconds_per_chunk,
        )
        media.slots.append(MediaSlot("video", vfeats.num_tokens, interleave=chunks))


def _single_turn_text(record: DataRecord) -> str:
    """The text of a one-user-turn record whose media all come before its text (what `ChatBuilder` renders)."""
    if len(record.messages) != 1 or record.messages[0].role != "user":
        raise ValueError(f"record {record.uid}: a plain-string chat template renders one user turn only")
    parts = record.messages[0].parts
    first_text = next((i for i, p in enumerate(parts) if p.type == "text"), len(parts))
    if any(p.type != "text" for p in parts[first_text:]):
        raise ValueError(f"record {record.uid}: a plain-string chat template renders media before the text only")
    return "".join(p.text for p in parts)


@dataclass
class _Media:
    """Processed media of one prompt, in order, and their chat slots."""

    slots: list[MediaSlot] = field(default_factory=list)
    images: list[ImageFeatures] = field(default_factory=list)
    videos: list[VideoFeatures] = field(default_factory=list)
    audios: list[AudioFeatures] = field(default_factory=list)

    def model_inputs(self, input_ids: list[int]) -> dict[str, torch.Tensor]:
        ids = torch.tensor([input_ids], dtype=torch.long)  # [1, T]
        out: dict[str, torch.Tensor] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if self.images:
            out["pixel_values"] = torch.cat([f.pixel_values for f in self.images])  # [sum patches, D]
            out["image_grid_thw"] = torch.stack([f.grid_thw for f in self.images])  # [n_img, 3]
        if self.videos:
            out["pixel_values_videos"] = torch.cat([f.pixel_values_videos for f in self.videos])
            out["video_grid_thw"] = torch.stack([f.grid_thw for f in self.videos])  # [n_vid, 3]
            seconds = [f.second_per_grid for f in self.videos]
            out["video_second_per_grid"] = torch.tensor(seconds, dtype=torch.float32)  # [n_vid]
        if len(self.audios) == 1:  # nothing to pad: no second copy of a long clip's features
            feats = self.audios[0].input_features
            out["input_features"] = feats.unsqueeze(0)  # [1, M, L]
            out["feature_attention_mask"] = torch.ones(1, feats.shape[1], dtype=torch.long)  # [1, L]
        elif self.audios:
            # [n_aud, M, L_max] and [n_aud, L_max]
            out["input_features"], out["feature_attention_mask"] = pad_audio_features(
                [a.input_features for a in self.audios]
            )
        return out


def pad_audio_features(features: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack ``[M, L_i]`` clips into ``[n, M, max L]`` (zeros after each clip) and a ``[n, max L]`` mask.

    The thinker's audio tower takes clips this way and packs them itself by the mask.
    """
    n, m = len(features), features[0].shape[0]
    longest = max(f.shape[1] for f in features)
    out = torch.zeros(n, m, longest, dtype=torch.float32)
    mask = torch.zeros(n, longest, dtype=torch.long)
    for i, f in enumerate(features):
        out[i, :, : f.shape[1]] = f
        mask[i, : f.shape[1]] = 1
    return out, mask


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
