"""Image path against transformers' Qwen2VLImageProcessor (PIL backend) and hand-made bad files."""

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from relax_modalities import (
    ImageSettings,
    MediaError,
    image_token_count,
    load_image,
    preprocess_image,
    probe_image_size,
    process_sample,
    smart_resize,
)
from relax_modalities.text import TinyTokenizer


def _reference(**kwargs: int):  # type: ignore[no-untyped-def]
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**kwargs)


@pytest.mark.parametrize(
    ("height", "width", "min_pixels", "max_pixels"),
    [(56, 56, 3136, 1003520), (100, 230, 3136, 1003520), (480, 640, 3136, 200_000), (37, 1000, 3136, 1003520),
     (20, 20, 100_000, 1003520), (333, 517, 3136, 50_000)],
)  # fmt: skip
def test_matches_qwen2vl_image_processor(height: int, width: int, min_pixels: int, max_pixels: int) -> None:
    rng = np.random.default_rng(height * width)
    img = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    ref = _reference(min_pixels=min_pixels, max_pixels=max_pixels)(images=[img], return_tensors="pt")
    ours = preprocess_image(img, ImageSettings(min_pixels=min_pixels, max_pixels=max_pixels))
    assert ours.pixel_values.shape == ref["pixel_values"].shape
    torch.testing.assert_close(ours.pixel_values, ref["pixel_values"].float(), atol=1e-5, rtol=0)
    assert ours.grid_thw.tolist() == ref["image_grid_thw"][0].tolist()
    assert ours.num_tokens == int(ref["image_grid_thw"].prod()) // 4


def test_token_count_is_known_before_decoding(tmp_path: Path) -> None:
    s = ImageSettings()
    # hand-derived: 56x56 -> 4x4 patches -> 2x2 tokens; 100x230 rounds to 112x224 -> 4x8 tokens.
    assert image_token_count(56, 56, s) == 4
    assert image_token_count(100, 230, s) == 32
    assert smart_resize(100, 230, 28, 3136, 1003520) == (112, 224)
    path = tmp_path / "x.png"
    Image.new("RGB", (230, 100), (1, 2, 3)).save(path)
    assert image_token_count(*probe_image_size(path), s) == preprocess_image(load_image(path)).num_tokens == 32


def test_exif_orientation_is_applied(tmp_path: Path) -> None:
    arr = np.zeros((40, 80, 3), dtype=np.uint8)
    arr[:, :40] = (255, 0, 0)  # left half red, right half blue
    arr[:, 40:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90° clockwise to display"
    path = tmp_path / "rot.jpg"
    Image.fromarray(arr).save(path, exif=exif, quality=95)
    img = load_image(path)
    assert img.size == (40, 80)  # width, height swapped
    top, bottom = np.asarray(img)[5, 20], np.asarray(img)[75, 20]
    assert top[0] > 200 and top[2] < 60  # red ends up on top after a clockwise turn
    assert bottom[2] > 200 and bottom[0] < 60
    assert probe_image_size(path) == (80, 40)


def test_modes_convert_to_rgb(tmp_path: Path) -> None:
    rgba = Image.new("RGBA", (56, 56), (255, 0, 0, 0))  # fully transparent -> white
    path = tmp_path / "a.png"
    rgba.save(path)
    assert np.asarray(load_image(path))[0, 0].tolist() == [255, 255, 255]
    grey = tmp_path / "g.png"
    Image.new("L", (56, 56), 77).save(grey)
    assert np.asarray(load_image(grey))[3, 3].tolist() == [77, 77, 77]


@pytest.mark.parametrize(
    ("ext", "options"),
    [("jpg", {"quality": 90}), ("png", {"save_all": True}), ("webp", {"save_all": True, "lossless": True}),
     ("tiff", {"save_all": True}), ("gif", {"save_all": True})],
)  # fmt: skip
def test_decoded_image_outlives_its_file(tmp_path: Path, ext: str, options: dict[str, bool | int]) -> None:
    # load_image decodes from a file it opens and closes itself; the image it returns must hold
    # Pillow's own decode of the first frame (multi-frame files included) and leave no file open
    # (an unclosed file is a ResourceWarning, an error under pytest).
    rng = np.random.default_rng(7)
    frames = [Image.fromarray(rng.integers(0, 256, (60, 90, 3), dtype=np.uint8)) for _ in range(3)]
    path = tmp_path / f"x.{ext}"
    extra = {"append_images": frames[1:]} if options.get("save_all") else {}
    frames[0].save(path, **options, **extra)
    with Image.open(path) as ref:
        expected = np.asarray(ref.convert("RGB"))
    img = load_image(path)
    np.testing.assert_array_equal(np.asarray(img), expected)
    ref_feats = _reference()(images=[Image.fromarray(expected)], return_tensors="pt")
    torch.testing.assert_close(preprocess_image(img).pixel_values, ref_feats["pixel_values"].float(), atol=1e-5, rtol=0)


def _png_bytes(size: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("L", size, 0).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        ("empty.png", b"", "empty file"),
        ("trunc.png", _png_bytes((64, 64))[:60], "decode failed"),
        ("garbage.png", b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4, "cannot open|not a recognised|decode failed"),
        ("sound.png", b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(40), "not a recognised image format"),
        ("bomb.png", _png_bytes((3000, 3000)), "decompression bomb"),
    ],
)
def test_bad_images_raise_media_error(tmp_path: Path, name: str, content: bytes, reason: str) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(MediaError, match=reason) as info:
        load_image(path, ImageSettings(max_decoded_pixels=4_000_000))
    assert info.value.modality == "image" and info.value.path == str(path)
    assert str(path) in str(info.value)


def test_missing_file_and_settings_validation(tmp_path: Path) -> None:
    with pytest.raises(MediaError, match="does not exist"):
        load_image(tmp_path / "nope.png")
    with pytest.raises(ValueError, match="max_pixels"):
        ImageSettings(min_pixels=10_000, max_pixels=5_000)


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG declaring ``width × height`` with one empty data chunk: a bomb as far as the header goes."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


@pytest.mark.parametrize("side", [10_000, 20_000])  # above Pillow's warning limit, and above its error limit
def test_pillow_sized_bombs_are_media_errors(tmp_path: Path, side: int) -> None:
    import warnings

    path = tmp_path / "huge.png"
    path.write_bytes(_png_header_only(side, side))
    with pytest.raises(MediaError, match="decompression bomb"):
        load_image(path)  # warnings are errors under pytest: Pillow's warning becomes the error
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # as in production: our own limit
        with pytest.raises(MediaError, match="decompression bomb"):
            probe_image_size(path)


@pytest.mark.parametrize("size", [(4000, 1), (1, 4000), (201, 1)])
def test_extreme_aspect_ratio_is_a_media_error_naming_the_file(tmp_path: Path, size: tuple[int, int]) -> None:
    # Qwen2-VL's encoder takes at most 200:1; a 1x4000 image used to escape as a plain ValueError.
    path = tmp_path / "strip.png"
    Image.new("RGB", size, (10, 20, 30)).save(path)
    for call in (load_image, probe_image_size):
        with pytest.raises(MediaError, match="aspect ratio too large") as info:
            call(path)
        assert info.value.path == str(path) and info.value.modality == "image"
    item = {"prompt": "which colour? r g", "media": [{"modality": "image", "path": str(path)}]}
    with pytest.raises(MediaError, match="aspect ratio") as info:
        process_sample(item, TinyTokenizer())
    assert info.value.path == str(path)


def test_aspect_ratio_200_is_still_accepted(tmp_path: Path) -> None:
    path = tmp_path / "ok.png"
    Image.new("RGB", (200, 1), (10, 20, 30)).save(path)
    assert preprocess_image(load_image(path)).num_tokens >= 1


@pytest.mark.parametrize("width", [256, 4096])
def test_16_bit_grey_png_keeps_its_gradient_in_8_bits(tmp_path: Path, width: int) -> None:
    # A 16-bit ramp over the full range; in 8 bits it must be the same ramp, v / 257 rounded
    # (65535 / 255 = 257 exactly), not Pillow's clipped conversion (every value above 255 → white).
    ramp = np.round(np.linspace(0, 65535, width)).astype(np.uint16)
    wide = np.tile(ramp, (32, 1))
    path = tmp_path / "ramp16.png"
    Image.fromarray(wide).save(path)
    with Image.open(path) as raw:
        assert raw.mode == "I;16"  # what the file holds, as Pillow reads it
    rgb = np.asarray(load_image(path))
    expected = np.round(ramp.astype(np.float64) / 257.0).astype(np.uint8)
    assert rgb.shape == (32, width, 3)
    for channel in range(3):
        np.testing.assert_array_equal(rgb[:, :, channel], np.tile(expected, (32, 1)))
    assert rgb[0, 0, 0] == 0 and rgb[0, -1, 0] == 255 and (rgb[0, :, 0] == 255).mean() < 0.01
