"""relax_modalities: per-modality data paths from file to Qwen2.5-Omni thinker input.

- image: `load_image` → `preprocess_image` (EXIF, RGB, smart resize, normalise, patchify).
- audio: `iter_audio_blocks` / `load_audio` (bounded-memory reads, mono, soxr) → `log_mel` (whole
  clip) or `log_mel_stream` (the same features block by block, what the loader runs),
  `chunk_features`, and `StreamingLogMel` for live PCM.
- video: `load_video` (decord, fps sampling, token budget, temporal patches, timestamps) and
  `open_audio_track` / `extract_audio_track` (PyAV); ``VideoSettings.layout="timestamped_frames"`` is Qwen3-VL's
  processor (its sampling and clip pixel budget, one block per temporal grid step after its ``<t seconds>`` text).
- text: `relax_modalities.text` (tiny tokenizer, vocabulary constants, chat builder).
- the modality seam: `ModalityPath` (what one modality owns: processing a file, its forward kwargs, packing,
  cost) and the registry `MODALITY_PATHS` (image, video, audio); a new modality is one module plus one entry.
- samples and batches: `process_sample` → thinker kwargs; `collate` / `pack_batch`;
  `cost_aware_batches`.
- loading: `build_loader` on torchdata.nodes with parallel decode, bounded prefetch, checkpointable
  state, and bad-file skipping (`MediaError`).
- dataset files: `build_stream` over JSONL, Parquet and Hugging Face `datasets` sources (`RowSource`) in
  verl's RL row schema (`RowSchema` → `DataRecord`), weighted mixing, bounded shuffle, exact resume,
  bad rows skipped and counted.
- synthetic tasks: `relax_modalities.synthetic`.

Names are resolved on first use (each from the module listed in ``_EXPORTS``): a process that only reads dataset
files (``build_stream``, ``DataStream``, ``DataRecord``, ``MediaError``) imports neither numpy nor torch, which the
image, audio and video paths bring.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the lazily imported names, for type checkers
    from relax_modalities._audio_io import (
        AudioSettings,
        expected_num_samples,
        extract_audio_track,
        iter_audio_blocks,
        load_audio,
        open_audio_track,
        resample,
    )
    from relax_modalities._collate import PackedBatch, collate, cost_aware_batches, estimate_cost, pack_batch
    from relax_modalities._errors import MediaError
    from relax_modalities._image import (
        OPENAI_CLIP_MEAN,
        OPENAI_CLIP_STD,
        ImageFeatures,
        ImageSettings,
        image_token_count,
        load_image,
        patchify_frames,
        preprocess_image,
        probe_image_size,
        smart_resize,
    )
    from relax_modalities._loader import LoaderStats, OmniLoader, ProcessedSample, build_loader
    from relax_modalities._media import MediaBundle, PackedMedia
    from relax_modalities._mel import (
        AudioFeatures,
        FeatureChunk,
        audio_token_count,
        chunk_features,
        log_mel,
        mel_filter_bank,
        min_audio_samples,
        num_feature_frames,
    )
    from relax_modalities._mel_stream import StreamingLogMel, log_mel_stream
    from relax_modalities._mix import TaskMixLoader, TaskMixSource, build_task_mix_loader
    from relax_modalities._modality import MODALITY_PATHS, ModalityPath, bundle_inputs, modality_path, modality_table
    from relax_modalities._paths import AudioPath, ImagePath, VideoPath
    from relax_modalities._rows import (
        BadRow,
        ChatMessage,
        ContentPart,
        DataRecord,
        MediaItem,
        RowSchema,
        media_columns,
        parse_row,
    )
    from relax_modalities._sample import ProcessorSettings, SampleProcessor, audio_in_video_chunks, process_sample
    from relax_modalities._sources import (
        DataFileError,
        HFDatasetSource,
        JsonlSource,
        ParquetSource,
        RowSource,
        open_source,
    )
    from relax_modalities._stream import BadRowInfo, BadRowStats, DataFileSpec, DataStream, build_stream
    from relax_modalities._video import (
        VideoFeatures,
        VideoPlan,
        VideoSettings,
        load_video,
        plan_video,
        probe_video,
        sample_frame_indices,
        video_features_from_frames,
    )
    from relax_modalities._video_frames import (
        clip_resize,
        grid_timestamps,
        plan_timestamped_video,
        sample_timestamped_indices,
        timestamp_text,
    )

_EXPORTS: dict[str, str] = {
    "AudioSettings": "relax_modalities._audio_io",
    "expected_num_samples": "relax_modalities._audio_io",
    "extract_audio_track": "relax_modalities._audio_io",
    "iter_audio_blocks": "relax_modalities._audio_io",
    "load_audio": "relax_modalities._audio_io",
    "open_audio_track": "relax_modalities._audio_io",
    "resample": "relax_modalities._audio_io",
    "PackedBatch": "relax_modalities._collate",
    "collate": "relax_modalities._collate",
    "cost_aware_batches": "relax_modalities._collate",
    "estimate_cost": "relax_modalities._collate",
    "pack_batch": "relax_modalities._collate",
    "MediaError": "relax_modalities._errors",
    "OPENAI_CLIP_MEAN": "relax_modalities._image",
    "OPENAI_CLIP_STD": "relax_modalities._image",
    "ImageFeatures": "relax_modalities._image",
    "ImageSettings": "relax_modalities._image",
    "image_token_count": "relax_modalities._image",
    "load_image": "relax_modalities._image",
    "patchify_frames": "relax_modalities._image",
    "preprocess_image": "relax_modalities._image",
    "probe_image_size": "relax_modalities._image",
    "smart_resize": "relax_modalities._image",
    "LoaderStats": "relax_modalities._loader",
    "OmniLoader": "relax_modalities._loader",
    "ProcessedSample": "relax_modalities._loader",
    "build_loader": "relax_modalities._loader",
    "MediaBundle": "relax_modalities._media",
    "PackedMedia": "relax_modalities._media",
    "AudioFeatures": "relax_modalities._mel",
    "FeatureChunk": "relax_modalities._mel",
    "audio_token_count": "relax_modalities._mel",
    "chunk_features": "relax_modalities._mel",
    "log_mel": "relax_modalities._mel",
    "mel_filter_bank": "relax_modalities._mel",
    "min_audio_samples": "relax_modalities._mel",
    "num_feature_frames": "relax_modalities._mel",
    "StreamingLogMel": "relax_modalities._mel_stream",
    "log_mel_stream": "relax_modalities._mel_stream",
    "TaskMixLoader": "relax_modalities._mix",
    "TaskMixSource": "relax_modalities._mix",
    "build_task_mix_loader": "relax_modalities._mix",
    "MODALITY_PATHS": "relax_modalities._modality",
    "ModalityPath": "relax_modalities._modality",
    "bundle_inputs": "relax_modalities._modality",
    "modality_path": "relax_modalities._modality",
    "modality_table": "relax_modalities._modality",
    "AudioPath": "relax_modalities._paths",
    "ImagePath": "relax_modalities._paths",
    "VideoPath": "relax_modalities._paths",
    "BadRow": "relax_modalities._rows",
    "ChatMessage": "relax_modalities._rows",
    "ContentPart": "relax_modalities._rows",
    "DataRecord": "relax_modalities._rows",
    "MediaItem": "relax_modalities._rows",
    "RowSchema": "relax_modalities._rows",
    "media_columns": "relax_modalities._rows",
    "parse_row": "relax_modalities._rows",
    "ProcessorSettings": "relax_modalities._sample",
    "SampleProcessor": "relax_modalities._sample",
    "audio_in_video_chunks": "relax_modalities._sample",
    "process_sample": "relax_modalities._sample",
    "DataFileError": "relax_modalities._sources",
    "HFDatasetSource": "relax_modalities._sources",
    "JsonlSource": "relax_modalities._sources",
    "ParquetSource": "relax_modalities._sources",
    "RowSource": "relax_modalities._sources",
    "open_source": "relax_modalities._sources",
    "BadRowInfo": "relax_modalities._stream",
    "BadRowStats": "relax_modalities._stream",
    "DataFileSpec": "relax_modalities._stream",
    "DataStream": "relax_modalities._stream",
    "build_stream": "relax_modalities._stream",
    "VideoFeatures": "relax_modalities._video",
    "VideoPlan": "relax_modalities._video",
    "VideoSettings": "relax_modalities._video",
    "load_video": "relax_modalities._video",
    "plan_video": "relax_modalities._video",
    "probe_video": "relax_modalities._video",
    "sample_frame_indices": "relax_modalities._video",
    "video_features_from_frames": "relax_modalities._video",
    "clip_resize": "relax_modalities._video_frames",
    "grid_timestamps": "relax_modalities._video_frames",
    "plan_timestamped_video": "relax_modalities._video_frames",
    "sample_timestamped_indices": "relax_modalities._video_frames",
    "timestamp_text": "relax_modalities._video_frames",
}
"""Name → module it is imported from when first used."""

__all__ = [  # errors
    "MediaError",
]
__all__ += [  # image
    "OPENAI_CLIP_MEAN",
    "OPENAI_CLIP_STD",
    "ImageFeatures",
    "ImageSettings",
    "image_token_count",
    "load_image",
    "patchify_frames",
    "preprocess_image",
    "probe_image_size",
    "smart_resize",
]
__all__ += [  # audio
    "AudioFeatures",
    "AudioSettings",
    "FeatureChunk",
    "StreamingLogMel",
    "audio_token_count",
    "chunk_features",
    "expected_num_samples",
    "extract_audio_track",
    "iter_audio_blocks",
    "load_audio",
    "log_mel",
    "log_mel_stream",
    "mel_filter_bank",
    "min_audio_samples",
    "num_feature_frames",
    "open_audio_track",
    "resample",
]
__all__ += [  # video
    "VideoFeatures",
    "VideoPlan",
    "VideoSettings",
    "load_video",
    "plan_video",
    "probe_video",
    "sample_frame_indices",
    "video_features_from_frames",
]
__all__ += [  # video, the timestamped-frames layout (Qwen3-VL's)
    "clip_resize",
    "grid_timestamps",
    "plan_timestamped_video",
    "sample_timestamped_indices",
    "timestamp_text",
]
__all__ += [  # the modality seam
    "MODALITY_PATHS",
    "AudioPath",
    "ImagePath",
    "MediaBundle",
    "ModalityPath",
    "PackedMedia",
    "VideoPath",
    "bundle_inputs",
    "modality_path",
    "modality_table",
]
__all__ += [  # samples and batches
    "PackedBatch",
    "ProcessorSettings",
    "SampleProcessor",
    "audio_in_video_chunks",
    "collate",
    "cost_aware_batches",
    "estimate_cost",
    "pack_batch",
    "process_sample",
]
__all__ += [  # loading
    "LoaderStats",
    "OmniLoader",
    "ProcessedSample",
    "TaskMixLoader",
    "TaskMixSource",
    "build_loader",
    "build_task_mix_loader",
]
__all__ += [  # dataset files
    "BadRow",
    "BadRowInfo",
    "BadRowStats",
    "ChatMessage",
    "ContentPart",
    "DataFileError",
    "DataFileSpec",
    "DataRecord",
    "DataStream",
    "HFDatasetSource",
    "JsonlSource",
    "MediaItem",
    "ParquetSource",
    "RowSchema",
    "RowSource",
    "build_stream",
    "media_columns",
    "open_source",
    "parse_row",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'relax_modalities' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
