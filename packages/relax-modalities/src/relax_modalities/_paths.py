"""The built-in modality paths (image, video with its optional sound track, audio) behind `ModalityPath`.

Each path decodes a file with its own module (`_image`, `_video`, `_audio_io` and `_mel_stream`), lays one
prompt's items out as the Qwen2.5-Omni thinker's forward kwargs and packs a batch of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from relax_modalities._audio_io import AudioSettings, expected_num_samples, iter_audio_blocks, open_audio_track
from relax_modalities._errors import MediaError, MediaModality
from relax_modalities._image import ImageFeatures, ImageSettings, load_image, preprocess_image
from relax_modalities._media import MediaBundle, PackedMedia
from relax_modalities._mel import AudioFeatures, audio_token_count, log_mel
from relax_modalities._mel_stream import log_mel_stream
from relax_modalities._video import VideoFeatures, VideoSettings, load_video
from relax_modalities._video_frames import timestamp_text
from relax_modalities.text import MediaSlot

if TYPE_CHECKING:
    from relax_modalities._sample import ProcessorSettings
    from relax_modalities.synthetic._manifest import MediaRef

__all__ = [
    "AUDIO",
    "IMAGE",
    "VIDEO",
    "AudioPath",
    "ImagePath",
    "VideoPath",
    "audio_features_from_blocks",
    "audio_features_from_waveform",
    "audio_in_video_chunks",
    "pad_audio_features",
]


def _offsets(grids: list[torch.Tensor]) -> torch.Tensor:
    sizes = torch.tensor([int(g.prod()) for g in grids], dtype=torch.long)
    return torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])


def _pack_patches(
    samples: Sequence[Mapping[str, torch.Tensor]], pixels: str, grid: str, extra: tuple[str, ...] = ()
) -> PackedMedia:
    """Patches of every prompt concatenated along the patch axis with their grids (never padded)."""
    grids: list[torch.Tensor] = []
    owner: list[int] = []
    for i, s in enumerate(samples):
        if grid in s:
            grids += list(s[grid])
            owner += [i] * len(s[grid])
    inputs: dict[str, torch.Tensor] = {}
    if grids:
        inputs[pixels] = torch.cat([s[pixels] for s in samples if grid in s])  # [sum patches, D]
        inputs[grid] = torch.stack(grids)  # [n, 3]
        for key in extra:
            inputs[key] = torch.cat([s[key] for s in samples if grid in s])
    return PackedMedia(inputs, torch.tensor(owner, dtype=torch.long), _offsets(grids))


class ImagePath:
    """Image: Pillow decode, smart resize, normalise, patchify (`load_image`, `preprocess_image`)."""

    name: str = "image"
    keys: tuple[str, ...] = ("pixel_values", "image_grid_thw")
    column: str = "images"
    default_settings: ImageSettings = ImageSettings()

    def process(self, ref: MediaRef, settings: ProcessorSettings, media: MediaBundle) -> None:
        """Decodes and patchifies one image; one slot of its token count."""
        own = settings.of("image", ImageSettings)
        feats = preprocess_image(load_image(ref.path, own), own)
        media.add("image", feats)
        media.slots.append(MediaSlot("image", feats.num_tokens))

    def model_inputs(self, items: Sequence[ImageFeatures]) -> dict[str, torch.Tensor]:
        """``pixel_values [sum patches, D]`` and ``image_grid_thw [n_img, 3]``."""
        return {
            "pixel_values": torch.cat([f.pixel_values for f in items]),  # [sum patches, D]
            "image_grid_thw": torch.stack([f.grid_thw for f in items]),  # [n_img, 3]
        }

    def pack(self, samples: Sequence[Mapping[str, torch.Tensor]]) -> PackedMedia:
        """Patches concatenated along the patch axis, grids stacked."""
        return _pack_patches(samples, "pixel_values", "image_grid_thw")

    def cost(self, sample: Mapping[str, torch.Tensor]) -> float:
        """Vision-encoder patches, one-for-one with text tokens."""
        return float(sample["pixel_values"].shape[0]) if "pixel_values" in sample else 0.0


class VideoPath:
    """Video: decord decode at the target fps, temporal patches (`load_video`); with ``audio_track`` also its
    sound track, as an audio item after the video or interleaved with its frames (``use_audio_in_video``)."""

    name: str = "video"
    keys: tuple[str, ...] = ("pixel_values_videos", "video_grid_thw", "video_second_per_grid")
    column: str = "videos"
    default_settings: VideoSettings = VideoSettings()

    def process(self, ref: MediaRef, settings: ProcessorSettings, media: MediaBundle) -> None:
        """Decodes one video (and its sound track when asked); its slot(s)."""
        own = settings.of("video", VideoSettings)
        if own.layout == "timestamped_frames" and ref.audio_track and settings.use_audio_in_video:
            raise MediaError(ref.path, "video", "use_audio_in_video has no timestamped-frames layout")
        vfeats = load_video(ref.path, own)
        media.add("video", vfeats)
        frames = None
        if own.layout == "timestamped_frames":  # each temporal grid step its own block, after its time
            blocks = vfeats.frame_blocks(own.vision.merge_size)
            frames = tuple((timestamp_text(t), n) for t, n in zip(vfeats.grid_timestamps, blocks, strict=True))
        if not ref.audio_track:
            media.slots.append(MediaSlot("video", vfeats.num_tokens, frames=frames))
            return
        sound = settings.of("audio", AudioSettings)  # the track is read as the audio path reads clips
        track = open_audio_track(ref.path, sound)
        if track is None:
            raise MediaError(ref.path, "video", "audio_track requested but the file has no audio stream")
        afeats = audio_features_from_blocks(track, sound, ref.path)
        media.add("audio", afeats)
        if not settings.use_audio_in_video:  # the track is its own audio span after the video
            media.slots += [MediaSlot("video", vfeats.num_tokens, frames=frames), MediaSlot("audio", afeats.num_tokens)]
            return
        chunks = audio_in_video_chunks(
            vfeats.grid_thw.tolist(),
            vfeats.second_per_grid,
            afeats.num_tokens,
            own.vision.merge_size,
            settings.position_id_per_seconds,
            settings.seconds_per_chunk,
        )
        media.slots.append(MediaSlot("video", vfeats.num_tokens, interleave=chunks))

    def model_inputs(self, items: Sequence[VideoFeatures]) -> dict[str, torch.Tensor]:
        """``pixel_values_videos [sum patches, D]``, ``video_grid_thw [n_vid, 3]``, ``video_second_per_grid
        [n_vid]``."""
        seconds = [f.second_per_grid for f in items]
        return {
            "pixel_values_videos": torch.cat([f.pixel_values_videos for f in items]),
            "video_grid_thw": torch.stack([f.grid_thw for f in items]),  # [n_vid, 3]
            "video_second_per_grid": torch.tensor(seconds, dtype=torch.float32),  # [n_vid]
        }

    def pack(self, samples: Sequence[Mapping[str, torch.Tensor]]) -> PackedMedia:
        """Patches concatenated along the patch axis, grids stacked, seconds per grid concatenated."""
        return _pack_patches(samples, "pixel_values_videos", "video_grid_thw", ("video_second_per_grid",))

    def cost(self, sample: Mapping[str, torch.Tensor]) -> float:
        """Vision-encoder patches, one-for-one with text tokens."""
        return float(sample["pixel_values_videos"].shape[0]) if "pixel_values_videos" in sample else 0.0


class AudioPath:
    """Audio: streamed block reads, resampling, log-mel frames as the blocks arrive (`log_mel_stream`)."""

    name: str = "audio"
    keys: tuple[str, ...] = ("input_features", "feature_attention_mask")
    column: str = "audios"
    default_settings: AudioSettings = AudioSettings()

    def process(self, ref: MediaRef, settings: ProcessorSettings, media: MediaBundle) -> None:
        """Log-mel features of one clip, streamed: memory grows with the features only, not with the samples."""
        s = settings.of("audio", AudioSettings)
        n = expected_num_samples(ref.path, s)  # header only: the features are preallocated, held once
        afeats = audio_features_from_blocks(iter_audio_blocks(ref.path, s), s, ref.path, num_samples=n)
        media.add("audio", afeats)
        media.slots.append(MediaSlot("audio", afeats.num_tokens))

    def model_inputs(self, items: Sequence[AudioFeatures]) -> dict[str, torch.Tensor]:
        """``input_features [n_aud, M, L_max]`` and ``feature_attention_mask [n_aud, L_max]``."""
        if len(items) == 1:  # nothing to pad: no second copy of a long clip's features
            feats = items[0].input_features
            mask = torch.ones(1, feats.shape[1], dtype=torch.long)  # [1, L]
            return {"input_features": feats.unsqueeze(0), "feature_attention_mask": mask}  # [1, M, L]
        padded, mask = pad_audio_features([a.input_features for a in items])
        return {"input_features": padded, "feature_attention_mask": mask}

    def pack(self, samples: Sequence[Mapping[str, torch.Tensor]]) -> PackedMedia:
        """Clips stacked ``[n_aud, M, L_max]`` with their mask (the audio tower packs them itself by the mask)."""
        owner: list[int] = []
        clips: list[torch.Tensor] = []
        for i, s in enumerate(samples):
            if "input_features" in s:
                owner += [i] * len(s["input_features"])
                lengths = s["feature_attention_mask"].sum(-1).tolist()
                clips += [f[:, : int(n)] for f, n in zip(s["input_features"], lengths, strict=True)]
        inputs: dict[str, torch.Tensor] = {}
        if clips:
            inputs["input_features"], inputs["feature_attention_mask"] = pad_audio_features(clips)
        return PackedMedia(inputs, torch.tensor(owner, dtype=torch.long))

    def cost(self, sample: Mapping[str, torch.Tensor]) -> float:
        """Audio-encoder frames after its first stride-2 conv."""
        if "feature_attention_mask" not in sample:
            return 0.0
        return float(sample["feature_attention_mask"].sum()) / 2


IMAGE = ImagePath()
VIDEO = VideoPath()
AUDIO = AudioPath()


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
