"""Video path: frame sampling, the token-budget rule, patch layout, timestamps, audio track, bad files."""

from pathlib import Path

import numpy as np
import pytest
import torch

from relax_modalities import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    MediaError,
    VideoSettings,
    extract_audio_track,
    load_video,
    plan_video,
    probe_video,
    sample_frame_indices,
)
from relax_modalities.synthetic import TaskItem, write_mp4


def _reference_patches(frames: np.ndarray, p: int = 14, m: int = 2, tp: int = 2) -> np.ndarray:
    """Loop-by-loop Qwen2-VL patch layout: rows (t, h-block, w-block, h-in, w-in), columns (c, t-in, y, x)."""
    x = (frames.astype(np.float64) / 255.0 - np.array(OPENAI_CLIP_MEAN)) / np.array(OPENAI_CLIP_STD)
    t, h, w, _ = frames.shape
    rows = []
    for gt in range(t // tp):
        for bh in range(h // p // m):
            for bw in range(w // p // m):
                for mh in range(m):
                    for mw in range(m):
                        y0, x0 = (bh * m + mh) * p, (bw * m + mw) * p
                        block = x[gt * tp : (gt + 1) * tp, y0 : y0 + p, x0 : x0 + p, :]  # [tp, p, p, c]
                        rows.append(block.transpose(3, 0, 1, 2).reshape(-1))
    return np.stack(rows)


def test_frame_sampling_by_fps_within_bounds() -> None:
    s = VideoSettings(fps=2.0, min_frames=4, max_frames=10)
    # 100 frames at 25 fps = 4 s -> 8 frames, evenly spaced and rounded.
    assert sample_frame_indices(100, 25.0, s).tolist() == [0, 14, 28, 42, 57, 71, 85, 99]
    # 1 s at 4 fps -> 2 wanted, raised to min_frames 4.
    assert sample_frame_indices(4, 4.0, s).tolist() == [0, 1, 2, 3]
    # 40 s -> 80 wanted, capped at max_frames 10.
    assert len(sample_frame_indices(1000, 25.0, s)) == 10
    # 3.7 s at 2 fps = 7.4 frames -> nearest multiple of the temporal patch (2) is 8.
    assert len(sample_frame_indices(37, 10.0, s)) == 8
    # odd bounds round inward to the temporal patch
    assert len(sample_frame_indices(4, 4.0, VideoSettings(min_frames=3, max_frames=768))) == 4


def test_token_budget_rule() -> None:
    # 112x112 frames, 8 frames = 4 temporal patches, 16 tokens per patch at full size = 64 tokens.
    full = plan_video(100, 25.0, 112, 112, VideoSettings(max_tokens=64))
    assert (full.height, full.width, full.num_tokens, len(full.frame_indices)) == (112, 112, 64, 8)
    # Budget 32: resolution first -> cap 32/4*784 = 6272 px -> 56x56 (4 tokens per patch) -> 16 tokens.
    res = plan_video(100, 25.0, 112, 112, VideoSettings(max_tokens=32))
    assert (res.height, res.width, res.num_tokens, len(res.frame_indices)) == (56, 56, 16, 8)
    # Budget 8: cap 1568 < min_pixels 3136 -> min resolution (4 tokens per patch), 2 patches = 4 frames.
    few = plan_video(100, 25.0, 112, 112, VideoSettings(max_tokens=8))
    assert (few.height, few.num_tokens, few.frame_indices.tolist()) == (56, 8, [0, 33, 66, 99])
    with pytest.raises(ValueError, match="max_tokens"):
        plan_video(100, 25.0, 112, 112, VideoSettings(max_tokens=3))


def _first(items: list[TaskItem], task: str) -> TaskItem:
    return next(it for it in items if it.task == task)


def test_load_video_layout_and_timestamps(synthetic_items: list[TaskItem]) -> None:
    import decord

    path = _first(synthetic_items, "video").media[0].path
    feats = load_video(path)
    # 4 frames of 56x56 at 4 fps: grid (2, 4, 4), 8 tokens, frames 0.25 s apart, 0.5 s per temporal patch.
    assert feats.grid_thw.tolist() == [2, 4, 4]
    assert feats.num_tokens == 8 == probe_video(path).num_tokens
    torch.testing.assert_close(feats.timestamps, torch.tensor([0.0, 0.25, 0.5, 0.75], dtype=torch.float64))
    assert feats.second_per_grid == pytest.approx(0.5)
    frames = decord.VideoReader(path, num_threads=1).get_batch([0, 1, 2, 3]).asnumpy()
    ref = _reference_patches(frames)
    np.testing.assert_allclose(feats.pixel_values_videos.numpy(), ref, atol=1e-5)


def test_resized_video_keeps_layout(synthetic_items: list[TaskItem]) -> None:
    path = _first(synthetic_items, "video").media[0].path
    feats = load_video(path, VideoSettings(min_pixels=112 * 112, max_pixels=112 * 112))
    assert feats.grid_thw.tolist() == [2, 8, 8] and feats.num_tokens == 32
    assert feats.pixel_values_videos.shape == (2 * 8 * 8, 3 * 2 * 14 * 14)


def test_audio_track_extraction(synthetic_items: list[TaskItem], tmp_path: Path) -> None:
    item = _first(synthetic_items, "audio_video")
    track = extract_audio_track(item.media[0].path)
    assert track is not None and abs(len(track) - 16000) < 1100  # 1 s plus the AAC frame padding
    spec = np.abs(np.fft.rfft(track[:16000]))
    peak = np.argmax(spec) * 16000 / 16000
    expected = 2000.0 if item.answer[1] == "h" else 250.0
    assert abs(peak - expected) < 0.06 * expected
    silent = tmp_path / "v.mp4"
    write_mp4(silent, np.zeros((4, 56, 56, 3), dtype=np.uint8), fps=4)
    assert extract_audio_track(silent) is None


def _mp4_bytes(tmp_path: Path) -> bytes:
    p = tmp_path / "ok.mp4"
    write_mp4(p, np.full((4, 56, 56, 3), 128, dtype=np.uint8), fps=4)
    return p.read_bytes()


@pytest.mark.parametrize(
    ("name", "kind", "reason"),
    [
        ("empty.mp4", "empty", "empty file"),
        ("trunc.mp4", "truncated", "cannot open container|cannot decode|frame decode failed"),
        ("garbage.mp4", "garbage", "cannot open container"),
        ("picture.mp4", "png", "cannot open container|no video"),
        ("bomb.mp4", "ok", "decompression bomb"),
    ],
)
def test_bad_videos_raise_media_error(tmp_path: Path, name: str, kind: str, reason: str) -> None:
    good = _mp4_bytes(tmp_path)
    content = {
        "empty": b"",
        "truncated": good[: len(good) // 3],
        "garbage": bytes(range(256)) * 8,
        "png": b"\x89PNG\r\n\x1a\n" + bytes(300),
        "ok": good,
    }[kind]
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(MediaError, match=reason) as info:
        load_video(path, VideoSettings(max_decoded_pixels=50 * 50))
    assert info.value.modality == "video" and str(path) in str(info.value)


def test_over_budget_video_is_a_media_error(tmp_path: Path) -> None:
    path = tmp_path / "big.mp4"
    path.write_bytes(_mp4_bytes(tmp_path))
    for fn in (load_video, probe_video):
        with pytest.raises(MediaError, match="max_tokens"):
            fn(path, VideoSettings(max_tokens=3))


def _qwen3_vl_settings(**kw: object) -> VideoSettings:
    from relax_modalities import ImageSettings

    vision = ImageSettings(
        patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=(0.5,) * 3, image_std=(0.5,) * 3
    )
    base: dict[str, object] = {"min_pixels": 4096, "max_pixels": 25165824, "layout": "timestamped_frames"}
    return VideoSettings(vision=vision, **{**base, **kw})  # type: ignore[arg-type]


def test_timestamped_frames_plan_pads_the_last_patch_and_bounds_the_clip() -> None:
    # 25 frames at 10 fps: int(2.5 s × 2 fps) = 5 frames (not rounded to the patch), at linspace(0, 24, 5).
    plan = plan_video(25, 10.0, 70, 150, _qwen3_vl_settings())
    assert plan.frame_indices.tolist() == [0, 6, 12, 18, 24]
    # Sides round(70 / 32) · 32 = 64 and round(150 / 32) · 32 = 160; 3 temporal steps of 2 × 5 merged tokens.
    assert (plan.height, plan.width, plan.num_tokens) == (64, 160, 30)
    # The clip budget: 4 · 64 · 160 = 40960 px over 20000 scales both sides by sqrt(5 · 70 · 150 / 20000) = 1.62:
    # floor(70 / 1.62 / 32) · 32 = 32, floor(150 / 1.62 / 32) · 32 = 64.
    small = plan_video(25, 10.0, 70, 150, _qwen3_vl_settings(max_pixels=20000))
    assert (small.height, small.width, small.num_tokens) == (32, 64, 6)
    # A short clip keeps min_frames 4 only as far as it has frames: 3 frames stay 3.
    assert plan_video(3, 30.0, 64, 64, _qwen3_vl_settings()).frame_indices.tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="over max_tokens 29"):
        plan_video(25, 10.0, 70, 150, _qwen3_vl_settings(max_tokens=29))


def test_cap_pixels_per_frame_caps_the_clip_budget() -> None:
    # 8 frames at 4 fps → 4 frames of 256 × 256. Cap: max(min(4 tokens · 32², 10⁸ // 4), int(4096 · 1.05)) = 4300 px
    # a frame, 17200 px the clip: scaled by sqrt(4 · 256² / 17200) = 3.90 to floor(256 / 3.90 / 32) · 32 = 64.
    capped = _qwen3_vl_settings(max_pixels=10**8, cap_pixels_per_frame=True, max_frame_tokens=4)
    plan = plan_video(8, 4.0, 256, 256, capped)
    assert (plan.height, plan.width, plan.num_tokens) == (64, 64, 8)
    assert plan_video(8, 4.0, 256, 256, _qwen3_vl_settings(max_pixels=10**8)).num_tokens == 2 * 8 * 8


def test_timestamped_frames_features_repeat_the_last_frame() -> None:
    from relax_modalities import video_features_from_frames

    settings = _qwen3_vl_settings()
    plan = plan_video(25, 10.0, 64, 96, settings)  # 5 frames, 64 × 96: no resize
    frames = np.random.default_rng(0).integers(0, 256, (5, 64, 96, 3), dtype=np.uint8)
    feats = video_features_from_frames(frames, plan, 10.0, settings)
    assert feats.grid_thw.tolist() == [3, 4, 6] and feats.frame_blocks(2) == (6, 6, 6)
    assert feats.grid_timestamps == pytest.approx((0.3, 1.5, 2.4))  # (0 + 0.6) / 2, (1.2 + 1.8) / 2, (2.4 + 2.4) / 2
    last = feats.pixel_values_videos[2 * 24 :].reshape(24, 3, 2, 16 * 16)  # the last step's patches [N, C, tp, p²]
    torch.testing.assert_close(last[:, :, 0], last[:, :, 1])  # its two frames are the 5th frame twice
    x = (frames[4, :16, :16].astype(np.float64) / 255 - 0.5) / 0.5  # its first patch: rows 0..15, columns 0..15
    np.testing.assert_allclose(last[0, :, 0].numpy(), x.transpose(2, 0, 1).reshape(3, -1), atol=1e-5)


def test_an_unknown_video_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="layout must be one of clip, timestamped_frames"):
        VideoSettings(layout="frames")  # type: ignore[arg-type]
