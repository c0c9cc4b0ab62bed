"""Video path: decord decode, fps sampling, per-video token budget, temporal patch grouping, timestamps.

Two layouts (`VideoSettings.layout`): ``"clip"`` (below: one placeholder block per clip, as Qwen2.5-VL and the
Qwen2.5-Omni thinker take it) and ``"timestamped_frames"`` (Qwen3-VL's processor: its own sampling and clip pixel
budget, and one block per temporal grid step after its timestamp text; `relax_modalities._video_frames`).

Token budget rule (stated): a video may take at most ``max_tokens`` placeholder tokens. Frames are
sampled first (target fps, clamped to [min_frames, max_frames], rounded to the temporal patch). Then
(1) resolution is reduced: the per-frame pixel cap becomes
``min(max_pixels, max_tokens / (frames / temporal_patch) * (patch * merge)**2)``; if that cap is
still at least ``min_pixels``, frames are resized within [min_pixels, cap] keeping aspect ratio.
(2) Otherwise frames are resized to the minimum resolution and the frame count is reduced to the
largest multiple of the temporal patch that fits, re-sampled evenly over the whole video. (3) If even
one temporal patch at minimum resolution does not fit, the video is rejected with `MediaError`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from relax_modalities._errors import MediaError, check_readable
from relax_modalities._image import ImageSettings, _normalise, _patch_order, smart_resize
from relax_modalities._video_frames import grid_timestamps, plan_timestamped_video

VideoLayout = Literal["clip", "timestamped_frames"]
VIDEO_LAYOUTS: tuple[VideoLayout, ...] = ("clip", "timestamped_frames")


@dataclass(frozen=True)
class VideoSettings:
    """How videos become vision-encoder patches.

    Attributes:
        fps: target sampling rate in frames per second.
        min_frames: fewest frames sampled (rounded up to the temporal patch).
        max_frames: most frames sampled (rounded down to the temporal patch).
        min_pixels: lower bound on a resized frame's height × width.
        max_pixels: upper bound on a resized frame's height × width.
        max_tokens: placeholder-token budget of one video (see the module docstring for the rule).
        max_decoded_pixels: frames whose declared width × height exceeds this are rejected.
        max_duration_s: videos declaring a longer duration are rejected.
        vision: patch geometry and normalisation shared with images.
        layout: ``"clip"``: frames rounded to the temporal patch, ``min_pixels`` / ``max_pixels`` bound one frame,
            ``max_tokens`` reduces resolution then frames (the module docstring), one placeholder block per clip;
            ``"timestamped_frames"``: Qwen3-VL's processor (`relax_modalities._video_frames`): frame count not
            rounded (the last frame repeats to fill the last patch), ``min_pixels`` / ``max_pixels`` bound the
            whole clip, ``max_tokens`` only rejects, and each temporal grid step is its own block after its
            ``<t seconds>`` text.
        cap_pixels_per_frame: ``"timestamped_frames"`` only: cap the clip budget per frame at
            ``max_frame_tokens`` tokens or an even share of ``max_pixels`` (the processor's option of that name).
        max_frame_tokens: the per-frame token cap of ``cap_pixels_per_frame`` (the processor's
            ``max_video_tokens``).
    """

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = 56 * 56
    max_pixels: int = 768 * 28 * 28
    max_tokens: int = 16_384
    max_decoded_pixels: int = 16_000_000
    max_duration_s: float = 4 * 3600.0
    vision: ImageSettings = field(default_factory=ImageSettings)
    layout: VideoLayout = "clip"
    cap_pixels_per_frame: bool = False
    max_frame_tokens: int = 768

    def __post_init__(self) -> None:
        if self.layout not in VIDEO_LAYOUTS:
            raise ValueError(f"VideoSettings.layout must be one of {', '.join(VIDEO_LAYOUTS)}, got {self.layout!r}")
        if self.max_frame_tokens < 1:
            raise ValueError(f"VideoSettings.max_frame_tokens must be >= 1, got {self.max_frame_tokens}")
        if self.fps <= 0:
            raise ValueError(f"VideoSettings.fps must be > 0, got {self.fps}")
        tp = self.vision.temporal_patch_size
        if self.min_frames < 1 or self.max_frames < max(self.min_frames, tp):
            raise ValueError(
                f"VideoSettings needs 1 <= min_frames <= max_frames and max_frames >= temporal_patch_size ({tp}), "
                f"got min_frames={self.min_frames}, max_frames={self.max_frames}"
            )
        if self.max_pixels < self.min_pixels:
            raise ValueError(f"VideoSettings.max_pixels ({self.max_pixels}) must be >= min_pixels ({self.min_pixels})")
        if self.max_tokens < 1:
            raise ValueError(f"VideoSettings.max_tokens must be >= 1, got {self.max_tokens}")


@dataclass
class VideoFeatures:
    """One video as the vision encoder takes it.

    Attributes:
        pixel_values_videos: ``[grid_t * grid_h * grid_w, 3 * temporal_patch * patch**2]`` float32.
        grid_thw: ``[3]`` int64 ``(grid_t, grid_h, grid_w)``.
        second_per_grid: seconds spanned by one temporal patch (the model's ``video_second_per_grid``).
        timestamps: ``[frames]`` float64 time in seconds of each sampled frame.
        frame_indices: ``[frames]`` int64 indices of the sampled frames in the file.
        num_tokens: placeholder tokens, ``prod(grid_thw) // merge**2``.
        grid_timestamps: seconds of each temporal grid step (the mean of its first and last frame's time; a
            last partial patch counts its repeated frame), as the timestamped-frames layout writes them.
    """

    pixel_values_videos: torch.Tensor
    grid_thw: torch.Tensor
    second_per_grid: float
    timestamps: torch.Tensor
    frame_indices: torch.Tensor
    num_tokens: int
    grid_timestamps: tuple[float, ...] = ()

    def frame_blocks(self, merge_size: int) -> tuple[int, ...]:
        """Tokens of each temporal grid step's block, ``grid_h · grid_w / merge²`` each."""
        t, h, w = (int(x) for x in self.grid_thw)
        return (h * w // merge_size**2,) * t


@dataclass(frozen=True)
class VideoPlan:
    """What will be decoded and at which size: frames, resized height and width, token count."""

    frame_indices: np.ndarray
    height: int
    width: int
    num_tokens: int


def _round_frames(n: float, tp: int, lo: int, hi: int) -> int:
    lo_r = math.ceil(lo / tp) * tp
    hi_r = max(tp, (hi // tp) * tp)
    n_r = max(tp, round(n / tp) * tp)
    return int(min(max(n_r, lo_r), hi_r))


def sample_frame_indices(num_frames: int, avg_fps: float, settings: VideoSettings) -> np.ndarray:
    """Evenly spaced frame indices at ``settings.fps``, count in [min_frames, max_frames], a multiple of tp.

    Args:
        num_frames: frames in the file.
        avg_fps: the file's average frame rate.
        settings: sampling parameters.

    Returns:
        ``[n]`` int64 indices (a short video repeats frames to reach ``min_frames``).
    """
    if num_frames < 1 or avg_fps <= 0:
        raise ValueError(f"need num_frames >= 1 and avg_fps > 0, got {num_frames}, {avg_fps}")
    tp = settings.vision.temporal_patch_size
    n = _round_frames(num_frames / avg_fps * settings.fps, tp, settings.min_frames, settings.max_frames)
    return np.linspace(0, num_frames - 1, n).round().astype(np.int64)


def plan_video(num_frames: int, avg_fps: float, height: int, width: int, settings: VideoSettings) -> VideoPlan:
    """Frames and size of a video under the token budget (the rule is in the module docstring).

    Raises:
        ValueError: when one temporal patch at the minimum resolution exceeds ``max_tokens`` (the timestamped-frames
            layout: see `relax_modalities._video_frames.plan_timestamped_video`).
    """
    if settings.layout == "timestamped_frames":
        return plan_timestamped_video(num_frames, avg_fps, height, width, settings)
    v = settings.vision
    f, tp = v.factor, v.temporal_patch_size
    idx = sample_frame_indices(num_frames, avg_fps, settings)
    groups = len(idx) // tp
    cap = min(settings.max_pixels, settings.max_tokens // groups * f * f)
    if cap >= settings.min_pixels:
        rh, rw = smart_resize(height, width, f, settings.min_pixels, cap)
    else:
        rh, rw = smart_resize(height, width, f, settings.min_pixels, max(settings.min_pixels, f * f))
        per_group = (rh // f) * (rw // f)
        fit = settings.max_tokens // per_group
        if fit < 1:
            raise ValueError(
                f"video of {height}x{width} needs {per_group} tokens per temporal patch at min_pixels, "
                f"over max_tokens {settings.max_tokens}"
            )
        idx = np.linspace(0, num_frames - 1, min(fit, groups) * tp).round().astype(np.int64)
    tokens = len(idx) // tp * (rh // f) * (rw // f)
    return VideoPlan(frame_indices=idx, height=rh, width=rw, num_tokens=tokens)


def _resize_frames(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    if frames.shape[1:3] == (height, width):
        return frames
    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float()  # [T, 3, H, W]
    y = torch.nn.functional.interpolate(x, size=(height, width), mode="bicubic", antialias=True, align_corners=False)
    return y.round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()


def probe_video(path: str | os.PathLike[str], settings: VideoSettings | None = None) -> VideoPlan:
    """Plan a video without decoding frames: frames to sample, resized size and token count.

    Raises:
        MediaError: for a file `load_video` would reject before decoding (including over budget).
    """
    settings = settings or VideoSettings()
    with _VideoFile(path, settings) as vf:
        return vf.plan(settings)


def _probe_size(path: os.PathLike[str]) -> tuple[int, int]:
    """Frame ``(height, width)`` from the container header (PyAV), before decord allocates anything."""
    import av

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise MediaError(path, "video", "no video stream")
            ctx = container.streams.video[0].codec_context
            if ctx.height < 1 or ctx.width < 1:
                raise MediaError(path, "video", f"no video stream with a frame size ({ctx.width}x{ctx.height})")
            return int(ctx.height), int(ctx.width)
    except MediaError:
        raise
    except Exception as exc:  # av raises InvalidDataError and friends for unreadable containers
        raise MediaError(path, "video", f"cannot open container: {str(exc)[:200]}") from exc


class _VideoFile:
    """A decord reader opened after the header checks that turn bad files into `MediaError`."""

    def __init__(self, path: str | os.PathLike[str], settings: VideoSettings) -> None:
        import decord

        self.path = check_readable(path, "video")
        self.height, self.width = _probe_size(self.path)
        if self.height * self.width > settings.max_decoded_pixels:
            raise MediaError(
                self.path,
                "video",
                f"decompression bomb: {self.width}x{self.height} frames exceed "
                f"max_decoded_pixels {settings.max_decoded_pixels}",
            )
        try:
            self.reader = decord.VideoReader(str(self.path), ctx=decord.cpu(0), num_threads=1)
        except Exception as exc:  # decord raises DECORDError (a RuntimeError) for anything it cannot open
            raise MediaError(self.path, "video", f"cannot decode: {str(exc).splitlines()[0][:200]}") from exc
        self.num_frames = len(self.reader)
        self.avg_fps = float(self.reader.get_avg_fps())
        if self.num_frames < 1 or not self.avg_fps > 0:
            raise MediaError(self.path, "video", "no video frames")
        if self.num_frames / self.avg_fps > settings.max_duration_s:
            raise MediaError(self.path, "video", f"too long: exceeds max_duration_s {settings.max_duration_s}")

    def plan(self, settings: VideoSettings) -> VideoPlan:
        try:
            return plan_video(self.num_frames, self.avg_fps, self.height, self.width, settings)
        except ValueError as exc:
            raise MediaError(self.path, "video", str(exc)) from exc

    def __enter__(self) -> _VideoFile:
        return self

    def __exit__(self, *exc: object) -> None:
        del self.reader


def load_video(path: str | os.PathLike[str], settings: VideoSettings | None = None) -> VideoFeatures:
    """Decode, sample, budget, resize, normalise and patchify one video file.

    Raises:
        MediaError: missing, empty, corrupt, truncated, unknown-format, oversized or over-budget file.
    """
    from decord.bridge.torchdl import to_torch

    settings = settings or VideoSettings()
    with _VideoFile(path, settings) as vf:
        plan = vf.plan(settings)
        try:
            batch = vf.reader.get_batch(plan.frame_indices.tolist())
            # decord's own DLPack bridge: a view of its buffer, where asnumpy() would copy every frame.
            frames = to_torch(batch).numpy()  # [T, H, W, 3] uint8
        except Exception as exc:
            raise MediaError(vf.path, "video", f"frame decode failed: {str(exc).splitlines()[0][:200]}") from exc
        return video_features_from_frames(frames, plan, vf.avg_fps, settings)


def video_features_from_frames(
    frames: np.ndarray, plan: VideoPlan, avg_fps: float, settings: VideoSettings
) -> VideoFeatures:
    """Resize, normalise and patchify already decoded frames ``[T, H, W, 3]`` uint8 per ``plan`` (a last partial
    temporal patch is filled by repeating the last frame, as Qwen3-VL's processor pads it)."""
    v = settings.vision
    frames = _resize_frames(frames, plan.height, plan.width)
    tp = v.temporal_patch_size
    if pad := -len(frames) % tp:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
    patches = _normalise(_patch_order(frames, tp, v), v)
    times = plan.frame_indices.astype(np.float64) / avg_fps
    n = len(plan.frame_indices)
    # Seconds one temporal patch spans: tp sample intervals of the evenly spaced sampling.
    span = (times[-1] - times[0]) / (n - 1) if n > 1 else 1.0 / avg_fps
    grid = (-(-n // tp), plan.height // v.patch_size, plan.width // v.patch_size)
    return VideoFeatures(
        pixel_values_videos=patches,
        grid_thw=torch.tensor(grid, dtype=torch.long),
        second_per_grid=float(tp * span) if span > 0 else float(tp / avg_fps),
        timestamps=torch.from_numpy(times),
        frame_indices=torch.from_numpy(plan.frame_indices),
        num_tokens=plan.num_tokens,
        grid_timestamps=tuple(grid_timestamps(plan.frame_indices, avg_fps, tp)),
    )
