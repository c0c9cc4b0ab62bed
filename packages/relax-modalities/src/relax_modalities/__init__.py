"""relax_modalities: per-modality data paths from file to Qwen2.5-Omni thinker input.

- image: `load_image` → `preprocess_image` (EXIF, RGB, smart resize, normalise, patchify).
- audio: `iter_audio_blocks` / `load_audio` (bounded-memory reads, mono, soxr) → `log_mel` (whole
  clip) or `log_mel_stream` (the same features block by block, what the loader runs),
  `chunk_features`, and `StreamingLogMel` for live PCM.
- video: `load_video` (decord, fps sampling, token budget, temporal patches, timestamps) and
  `open_audio_track` / `extract_audio_track` (PyAV).
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
"""

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
)

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
