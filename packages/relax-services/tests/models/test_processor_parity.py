"""The data path equals the checkpoint's own processors: a prompt built from the default folder has the pixel
values and audio features that transformers' auto processors, configured by that folder's
``preprocessor_config.json``, produce on the same files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import soundfile as sf
import torch
from PIL import Image
from transformers import AutoFeatureExtractor, AutoImageProcessor

from relax_modalities.synthetic import MediaRef, TaskItem
from relax_services.config import ModelConfig
from relax_services.data.run_data import PromptBuilder
from relax_services.models import DEFAULT_SOURCE, open_checkpoint

CKPT = open_checkpoint(DEFAULT_SOURCE)


def test_image_pixels_equal_the_checkpoints_image_processor(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    path = tmp_path / "x.png"
    Image.fromarray(rng.integers(0, 256, (70, 150, 3), dtype=np.uint8)).save(path)
    item = TaskItem(id="i", task="image", prompt="which colour? r g", media=(MediaRef("image", str(path)),))
    prompt = PromptBuilder(ModelConfig())(item)
    ref = AutoImageProcessor.from_pretrained(CKPT.path, local_files_only=True)(
        images=[Image.open(path).convert("RGB")], return_tensors="pt"
    )
    assert prompt.image_grid_thw is not None and prompt.pixel_values is not None
    assert prompt.image_grid_thw.tolist() == ref["image_grid_thw"].tolist()
    torch.testing.assert_close(prompt.pixel_values, ref["pixel_values"].float(), atol=1e-5, rtol=0)


def test_audio_features_equal_the_checkpoints_feature_extractor(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    wave = (0.3 * np.sin(np.arange(16000) * 0.2) + 0.05 * rng.standard_normal(16000)).astype(np.float32)
    path = tmp_path / "x.wav"
    sf.write(path, wave, 16000, subtype="FLOAT")
    item = TaskItem(id="a", task="audio", prompt="pitch? l h", media=(MediaRef("audio", str(path)),))
    prompt = PromptBuilder(ModelConfig())(item)
    extractor = AutoFeatureExtractor.from_pretrained(CKPT.path, local_files_only=True)
    ref = extractor(wave, sampling_rate=16000, padding="longest", return_attention_mask=True, return_tensors="pt")
    assert prompt.input_features is not None and prompt.feature_attention_mask is not None
    assert prompt.input_features.shape == ref["input_features"].shape
    assert prompt.feature_attention_mask.tolist() == ref["attention_mask"].tolist()
    # relax-modalities' stated Whisper tolerance (its float32 STFT against the extractor's float64 numpy one).
    torch.testing.assert_close(prompt.input_features, ref["input_features"], atol=1e-4, rtol=0)


def test_qwen3_vl_image_pixels_equal_its_image_processor(tmp_path: Path) -> None:
    # Qwen3-VL's preprocessor config gives its pixel budget as ``size`` (shortest / longest edge), not min / max
    # pixels; with patch 16 and mean / std 0.5 every part of the geometry and normalisation differs from the default.
    from relax_services.models.tiny_families import write_tiny_checkpoint

    folder = write_tiny_checkpoint(tmp_path / "q3vl", "qwen3-vl")
    rng = np.random.default_rng(2)
    path = tmp_path / "x.png"
    Image.fromarray(rng.integers(0, 256, (70, 150, 3), dtype=np.uint8)).save(path)
    item = TaskItem(id="i", task="image", prompt="which colour? r g", media=(MediaRef("image", str(path)),))
    prompt = PromptBuilder(ModelConfig(source=str(folder)))(item)
    ref = AutoImageProcessor.from_pretrained(folder, local_files_only=True)(
        images=[Image.open(path).convert("RGB")], return_tensors="pt"
    )
    assert prompt.image_grid_thw is not None and prompt.pixel_values is not None
    # 70 × 150 px × sqrt(65536 / 10500) = 2.498, sides ceiled to 32 px: 192 × 384 px, a 12 × 24 grid of 16-px patches
    # (the default 3136 px minimum would keep 64 × 160 px).
    assert prompt.image_grid_thw.tolist() == ref["image_grid_thw"].tolist() == [[1, 12, 24]]
    torch.testing.assert_close(prompt.pixel_values, ref["pixel_values"].float(), atol=1e-5, rtol=0)
