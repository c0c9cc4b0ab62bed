"""Qwen3-VL video through relax's data path equals transformers' own Qwen3-VL code on the same decoded frames: the
rendered prompt's token ids (timestamps and per-frame blocks) and ``pixel_values_videos`` / ``video_grid_thw``.

AutoProcessor needs torchvision, which is not installed; so transformers' pieces that do not are called, and the two
torchvision calls between them are reproduced:

- called: ``Qwen3VLVideoProcessor.from_pretrained`` (the checkpoint's ``video_preprocessor_config.json``), its
  ``sample_frames``, the module's ``smart_resize``, its fused mean / std (``_fuse_mean_std_and_rescale_factor``) and
  ``patchify``; ``Qwen3VLProcessor.replace_video_token`` (timestamps and blocks) and ``get_text_with_replacements``
  (the text expansion), and the tokenizer;
- reproduced: ``tvF.resize`` (bicubic, antialiased, on float, rounded back to uint8: torchvision's float path) and
  ``tvF.normalize`` (``(x - mean) / std`` per channel);
- decoded once with decord, for both: the processor's own decoders are not part of this comparison.
"""

from __future__ import annotations

from pathlib import Path

import decord
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize
from transformers.video_utils import VideoMetadata

from relax_modalities import (
    ImageSettings,
    VideoSettings,
    clip_resize,
    grid_timestamps,
    plan_timestamped_video,
    sample_timestamped_indices,
)
from relax_modalities.synthetic import MediaRef, TaskItem, write_mp4
from relax_services.config import ModelConfig
from relax_services.data.run_data import PromptBuilder, processor_settings
from relax_services.models import open_checkpoint
from relax_services.models.tiny_families import write_tiny_checkpoint

# The tiny tokenizer's names of the strings Qwen3-VL's processor writes (its defaults are the published tokens').
_TOKENS = {
    "video_token": "<|VIDEO|>",
    "image_token": "<|IMAGE|>",
    "vision_start_token": "<|vision_bos|>",
    "vision_end_token": "<|vision_eos|>",
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("q3vl") / "ckpt", "qwen3-vl", seed=0)


def _clip(path: Path, frames: int, height: int, width: int, fps: int) -> Path:
    rng = np.random.default_rng(frames)
    y, x = np.mgrid[0:height, 0:width]
    video = np.empty((frames, height, width, 3), dtype=np.uint8)
    for k in range(frames):  # a moving gradient plus noise: resampling differences would show
        base = (x * 2 + y + 9 * k) % 256
        video[k] = np.clip(base[..., None] + rng.integers(-20, 21, (height, width, 3)), 0, 255).astype(np.uint8)
    write_mp4(path, video, fps=fps)
    return path


def _reference(folder: Path, path: Path, prompt_text: str) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Token ids, patches and grid of one video prompt by transformers' Qwen3-VL code (the module docstring)."""
    reader = decord.VideoReader(str(path), ctx=decord.cpu(0), num_threads=1)
    decoded = reader.get_batch(list(range(len(reader)))).asnumpy()  # [N, H, W, 3] uint8
    vp = Qwen3VLVideoProcessor.from_pretrained(folder, local_files_only=True)
    metadata = VideoMetadata(total_num_frames=len(reader), fps=float(reader.get_avg_fps()))
    indices = vp.sample_frames(metadata)
    metadata.frames_indices = indices  # as the processor's _decode_and_sample_videos records them
    video = torch.from_numpy(decoded[indices]).permute(0, 3, 1, 2).contiguous()  # [T, C, H, W] uint8
    factor = vp.patch_size * vp.merge_size
    h, w = smart_resize(
        len(indices),
        video.shape[-2],
        video.shape[-1],
        temporal_factor=vp.temporal_patch_size,
        factor=factor,
        min_pixels=vp.size.shortest_edge,
        max_pixels=vp.size.longest_edge,
    )
    resized = torch.nn.functional.interpolate(  # reproduced tvF.resize
        video.float(), size=(h, w), mode="bicubic", align_corners=False, antialias=True
    )
    resized = resized.clamp_(0, 255).round_().to(torch.uint8)
    mean, std, _ = vp._fuse_mean_std_and_rescale_factor(
        do_normalize=True,
        image_mean=tuple(vp.image_mean),
        image_std=tuple(vp.image_std),
        do_rescale=True,
        rescale_factor=vp.rescale_factor,
        device=resized.device,
    )
    normalised = (resized.float() - mean[:, None, None]) / std[:, None, None]  # reproduced tvF.normalize
    patches, gt, gh, gw = vp.patchify(
        normalised[None], patch_size=vp.patch_size, merge_size=vp.merge_size, temporal_patch_size=vp.temporal_patch_size
    )
    grid = torch.tensor([[gt, gh, gw]])

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    processor = Qwen3VLProcessor.__new__(Qwen3VLProcessor)  # its __init__ looks up torchvision's video classes
    processor.tokenizer, processor.video_processor = tokenizer, vp
    for name, token in _TOKENS.items():
        setattr(processor, name, token)
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": prompt_text}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    replacement = processor.replace_video_token({"video_grid_thw": grid, "video_metadata": [metadata]}, 0)
    expanded, _ = processor.get_text_with_replacements([text], videos_replacements=[replacement])
    ids = tokenizer(expanded[0], add_special_tokens=False).input_ids
    return list(ids), patches[0], grid


@pytest.mark.parametrize(
    ("frames", "height", "width", "fps", "grid"),
    [
        # 25 frames at 10 fps: int(2.5 s × 2) = 5 frames (odd: the last repeats), indices 0 6 12 18 24. Sides
        # round(70 / 32) · 32 = 64, round(150 / 32) · 32 = 160; 4 · 64 · 160 px is within 4096 .. 25165824: 3 steps
        # of a 4 × 10 patch grid.
        (25, 70, 150, 10, [3, 4, 10]),
        # 4 frames at 4 fps (the synthetic video task's): int(1 s × 2) = 2, raised to min_frames 4 (even: no repeat);
        # 56 × 84 px rounds to 64 × 96: 2 steps of a 4 × 6 patch grid.
        (4, 56, 84, 4, [2, 4, 6]),
    ],
)
def test_video_prompt_equals_transformers_qwen3_vl_code(
    folder: Path, tmp_path: Path, frames: int, height: int, width: int, fps: int, grid: list[int]
) -> None:
    path = _clip(tmp_path / "clip.mp4", frames, height, width, fps)
    item = TaskItem(id="v", task="video", prompt="move? l r u d", media=(MediaRef("video", str(path)),))
    prompt = PromptBuilder(ModelConfig(source=str(folder)))(item)
    ids, pixels, ref_grid = _reference(folder, path, "move? l r u d")
    assert ref_grid.tolist() == [grid]
    assert prompt.video_grid_thw is not None and prompt.pixel_values_videos is not None
    assert prompt.video_grid_thw.tolist() == [grid]
    assert prompt.input_ids.tolist() == ids
    torch.testing.assert_close(prompt.pixel_values_videos, pixels, atol=1e-5, rtol=0)


def test_timestamps_are_rendered_before_each_frame_block(folder: Path, tmp_path: Path) -> None:
    path = _clip(tmp_path / "clip.mp4", 25, 70, 150, 10)
    item = TaskItem(id="v", task="video", prompt="move?", media=(MediaRef("video", str(path)),))
    prompt = PromptBuilder(ModelConfig(source=str(folder)))(item)
    text = open_checkpoint(folder).tokenizer.decode(prompt.input_ids.tolist())
    # Frames 0 6 12 18 24 (24 repeated) at 10 fps: patch means (0 + 0.6) / 2, (1.2 + 1.8) / 2, (2.4 + 2.4) / 2 s.
    block = "<|vision_bos|>" + "<|VIDEO|>" * 10 + "<|vision_eos|>"
    expected = f"<|vision_bos|><0.3 seconds>{block}<1.5 seconds>{block}<2.4 seconds>{block}<|vision_eos|>"
    assert expected in text


def test_the_checkpoints_video_settings_are_read(folder: Path) -> None:
    video = processor_settings(open_checkpoint(folder)).video
    assert video.layout == "timestamped_frames"
    assert (video.fps, video.min_frames, video.max_frames) == (2.0, 4, 768)
    assert (video.min_pixels, video.max_pixels) == (4096, 25165824)  # the video config's, not the image's
    assert (video.vision.patch_size, video.vision.image_mean) == (16, (0.5, 0.5, 0.5))


def test_clip_resize_equals_the_processors_smart_resize() -> None:
    # Over and under the clip budget, frames under the factor (scaled up first), odd frame counts.
    cases = [(5, 70, 150), (4, 24, 40), (3, 10, 700), (17, 1080, 1920), (768, 720, 1280), (2, 33, 31), (9, 500, 20)]
    for frames, h, w in cases:
        for lo, hi in [(4096, 25165824), (131072, 786432), (65536, 65536 * 4)]:
            ours = clip_resize(frames, h, w, 2, 32, lo, hi)
            assert ours == smart_resize(frames, h, w, temporal_factor=2, factor=32, min_pixels=lo, max_pixels=hi)


@pytest.mark.parametrize("cap", [False, True])
def test_video_patch_counts_equal_the_processors(cap: bool) -> None:
    # The processor's own count (its get_num_of_video_patches, with and without the per-frame cap) for the frames
    # our sampling takes: long and short clips, large and small frames.
    vp = Qwen3VLVideoProcessor(cap_pixels_per_frame=cap)
    settings = VideoSettings(
        min_pixels=vp.size["shortest_edge"],
        max_pixels=vp.size["longest_edge"],
        vision=ImageSettings(patch_size=16),
        layout="timestamped_frames",
        cap_pixels_per_frame=cap,
        max_tokens=10**9,
    )
    for total, fps, h, w in [
        (25, 10.0, 70, 150),
        (900, 30.0, 720, 1280),
        (12_000, 25.0, 1080, 1920),
        (40, 8.0, 240, 320),
    ]:
        plan = plan_timestamped_video(total, fps, h, w, settings)
        patches = vp.get_num_of_video_patches(len(plan.frame_indices), h, w, {"cap_pixels_per_frame": cap})
        assert plan.num_tokens * 4 == patches, (total, fps, h, w)


def test_sampling_and_timestamps_equal_the_processors_functions() -> None:
    # Frame counts over the clamps (min 4, max 768 frames, the file's own count), each against the processor's.
    vp = Qwen3VLVideoProcessor(fps=2, min_frames=4, max_frames=768)
    processor = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    settings = VideoSettings(fps=2.0, min_frames=4, max_frames=768, layout="timestamped_frames")
    for total, fps in [(3, 30.0), (25, 10.0), (300, 29.97), (91, 24.0), (10_000, 5.0)]:
        ours = sample_timestamped_indices(total, fps, settings)
        theirs = vp.sample_frames(VideoMetadata(total_num_frames=total, fps=fps))
        assert ours.tolist() == theirs.tolist(), (total, fps)
        assert grid_timestamps(ours, fps, 2) == processor._calculate_timestamps(theirs, fps, 2)


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        ("num_frames", 8, "num_frames=8 is not supported"),
        ("do_sample_frames", False, "do_sample_frames=False is not supported"),
        ("fps", "fast", "'fps' must be a number"),
    ],
)
def test_a_video_config_relax_cannot_follow_is_refused(tmp_path: Path, key: str, value: object, reason: str) -> None:
    import json

    folder = write_tiny_checkpoint(tmp_path / "q3vl", "qwen3-vl", seed=0)
    config = json.loads((folder / "video_preprocessor_config.json").read_text())
    (folder / "video_preprocessor_config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(ValueError, match=reason):
        processor_settings(open_checkpoint(folder))
