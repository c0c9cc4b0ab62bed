"""The timestamped-frames video layout (Qwen3-VL's): frame sampling, clip pixel budget and per-step timestamps.

Qwen3-VL's video processor differs from the clip layout of `relax_modalities._video` in four ways, each
reproduced here as transformers 5 writes it (``models/qwen3_vl/video_processing_qwen3_vl.py`` and
``processing_qwen3_vl.py``):

- Sampling: ``n = int(frames / avg_fps * fps)`` clamped to ``[min_frames, max_frames]`` and to the file's frame
  count, at ``linspace(0, frames - 1, n)`` rounded; ``n`` is *not* rounded to the temporal patch: the last
  sampled frame is repeated to fill the last patch.
- Pixel budget: ``min_pixels`` / ``max_pixels`` (the processor's ``size`` ``shortest_edge`` / ``longest_edge``)
  bound the whole clip, ``frames × height × width`` with frames rounded to the temporal patch, not one frame.
  With ``cap_pixels_per_frame`` the clip budget is first capped to ``max_frame_tokens`` per frame.
- Timestamps: each temporal grid step's time is the mean of its first and last frame's ``index / avg_fps``
  (indices padded like the frames), written ``<{t:.1f} seconds>``.
- Layout: every temporal grid step is its own block ``<t seconds><vision_start> pads <vision_end>`` of
  ``grid_h · grid_w / merge²`` tokens, all in place of the one video placeholder the chat template renders.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from relax_modalities._image import MAX_ASPECT_RATIO

if TYPE_CHECKING:
    from relax_modalities._video import VideoPlan, VideoSettings

__all__ = [
    "clip_resize",
    "grid_timestamps",
    "plan_timestamped_video",
    "sample_timestamped_indices",
    "timestamp_text",
]


def sample_timestamped_indices(num_frames: int, avg_fps: float, settings: VideoSettings) -> np.ndarray:
    """Frame indices as Qwen3-VL's ``sample_frames``: ``int(num_frames / avg_fps * fps)`` clamped to
    ``[min_frames, max_frames]`` and to ``num_frames``, evenly spaced and rounded.

    Raises:
        ValueError: for no frames or a non-positive frame rate.
    """
    if num_frames < 1 or avg_fps <= 0:
        raise ValueError(f"need num_frames >= 1 and avg_fps > 0, got {num_frames}, {avg_fps}")
    n = int(num_frames / avg_fps * settings.fps)
    n = min(max(n, settings.min_frames), settings.max_frames, num_frames)
    return np.linspace(0, num_frames - 1, n).round().astype(np.int64)


def clip_resize(
    num_frames: int, height: int, width: int, temporal_patch: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Frame size under a whole-clip pixel budget (Qwen3-VL's video ``smart_resize``): sides rounded to multiples of
    ``factor``; if ``frames × h × w`` (frames rounded to the temporal patch) is over ``max_pixels``, both sides
    scaled down by ``sqrt(frames · height · width / max_pixels)`` and floored; if under ``min_pixels``, scaled up
    and ceiled. Frames smaller than ``factor`` are first scaled up to it.

    Raises:
        ValueError: fewer frames than the temporal patch, or an aspect ratio above 200.
    """
    if num_frames < temporal_patch:
        raise ValueError(f"{num_frames} sampled frames, fewer than the temporal patch {temporal_patch}")
    if min(height, width) < 1:
        raise ValueError(f"frame size must be positive, got {height}x{width}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"absolute aspect ratio must be at most {MAX_ASPECT_RATIO}, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_patch) * temporal_patch
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _clip_budget(num_frames: int, factor: int, settings: VideoSettings) -> int:
    """``max_pixels`` of the whole clip, capped per frame when ``cap_pixels_per_frame`` (qwen-vl-utils' rule)."""
    if not settings.cap_pixels_per_frame:
        return settings.max_pixels
    per_frame = max(
        min(settings.max_frame_tokens * factor * factor, settings.max_pixels // num_frames),
        int(settings.min_pixels * 1.05),
    )
    return per_frame * num_frames


def plan_timestamped_video(
    num_frames: int, avg_fps: float, height: int, width: int, settings: VideoSettings
) -> VideoPlan:
    """Frames and size of a video in the timestamped-frames layout (the module docstring's rule).

    Raises:
        ValueError: fewer sampled frames than the temporal patch, a bad aspect ratio, or more tokens than
            ``settings.max_tokens`` (this layout's budget is the pixel budget; ``max_tokens`` only rejects).
    """
    from relax_modalities._video import VideoPlan

    v = settings.vision
    tp, f = v.temporal_patch_size, v.factor
    idx = sample_timestamped_indices(num_frames, avg_fps, settings)
    n = len(idx)
    rh, rw = clip_resize(n, height, width, tp, f, settings.min_pixels, _clip_budget(n, f, settings))
    tokens = math.ceil(n / tp) * (rh // f) * (rw // f)
    if tokens > settings.max_tokens:
        raise ValueError(
            f"video of {height}x{width}, {n} frames needs {tokens} tokens, over max_tokens {settings.max_tokens}"
        )
    return VideoPlan(frame_indices=idx, height=rh, width=rw, num_tokens=tokens)


def grid_timestamps(frame_indices: np.ndarray, avg_fps: float, temporal_patch: int) -> list[float]:
    """Seconds of each temporal grid step: the mean of its first and last frame's ``index / avg_fps``, the
    indices padded with the last one to a whole patch (Qwen3-VL's ``_calculate_timestamps``)."""
    indices = [int(i) for i in frame_indices]
    if len(indices) % temporal_patch:
        indices += [indices[-1]] * (temporal_patch - len(indices) % temporal_patch)
    times = [i / avg_fps for i in indices]
    return [(times[i] + times[i + temporal_patch - 1]) / 2 for i in range(0, len(times), temporal_patch)]


def timestamp_text(seconds: float) -> str:
    """The text written before a temporal grid step's block: ``<1.5 seconds>``."""
    return f"<{seconds:.1f} seconds>"
