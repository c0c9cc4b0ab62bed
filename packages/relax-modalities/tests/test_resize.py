"""Threads per image: a banded bicubic resize bit for bit equal to one ``Image.resize`` call, banded
patchify equal to the whole-image one, both wired into the image path, and the loader's thread budget."""

import multiprocessing as mp

import numpy as np
import pytest
import torch
from PIL import Image

from relax_modalities import ImageSettings, ProcessorSettings, preprocess_image
from relax_modalities import _image as image_module
from relax_modalities import _loader as loader_module
from relax_modalities._loader import worker_settings
from relax_modalities._resize import resize_bicubic, resize_bicubic_into

BICUBIC = Image.Resampling.BICUBIC


def _random_image(rng: np.random.Generator, height: int, width: int) -> Image.Image:
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _one_call(image: Image.Image, width: int, height: int) -> np.ndarray:
    return np.asarray(image.resize((width, height), BICUBIC))


def test_equals_one_call_resize_on_random_sizes() -> None:
    # Sizes drawn independently per axis: upscales, downscales, one axis up and one down, unchanged
    # axes, odd and prime sizes, bands of one or two rows, and both pass orders of Pillow 13.
    rng = np.random.default_rng(20240611)
    cases = [(int(a), int(b), int(c), int(d)) for a, b, c, d in rng.integers(1, 400, (300, 4))]
    cases += [(480, 640, 364, 504), (480, 640, 476, 644), (333, 517, 336, 504), (7, 3, 2, 5), (2, 900, 1, 13)]
    cases += [(101, 97, 101, 50), (101, 97, 40, 97)]  # one axis unchanged: a single pass
    for in_h, in_w, out_h, out_w in cases:
        image = _random_image(rng, in_h, in_w)
        expected = _one_call(image, out_w, out_h)
        for threads in (2, 3, 4):
            got = resize_bicubic(image, out_w, out_h, threads)
            assert got.dtype == np.uint8 and got.shape == (out_h, out_w, 3)
            assert np.array_equal(got, expected), (in_h, in_w, out_h, out_w, threads)


def test_pass_order_is_pillows() -> None:
    # The intermediate is rounded to uint8, so the order of the passes shows in the pixels: for this
    # size the two orders differ, and only the one Pillow itself picks equals the one-call resize.
    image = _random_image(np.random.default_rng(3), 480, 640)
    expected = _one_call(image, 644, 476)
    horizontal_first = np.asarray(image.resize((644, 480), BICUBIC).resize((644, 476), BICUBIC))
    vertical_first = np.asarray(image.resize((640, 476), BICUBIC).resize((644, 476), BICUBIC))
    assert not np.array_equal(horizontal_first, vertical_first)
    assert np.array_equal(resize_bicubic(image, 644, 476, 2), expected)


def _resize_in_child(queue: "mp.Queue[bool]") -> None:
    image = _random_image(np.random.default_rng(5), 300, 200)
    queue.put(bool(np.array_equal(resize_bicubic(image, 150, 280, 2), _one_call(image, 150, 280))))


def test_works_in_a_forked_child_after_the_parent_used_its_threads() -> None:
    # A forked child has none of the parent's pool threads; reusing the parent's pool would hang.
    image = _random_image(np.random.default_rng(4), 64, 64)
    resize_bicubic(image, 30, 90, 2)
    ctx = mp.get_context("fork")
    queue: mp.Queue[bool] = ctx.Queue()
    child = ctx.Process(target=_resize_in_child, args=(queue,))
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
        pytest.fail("resize in a forked child did not finish")
    assert child.exitcode == 0 and queue.get(timeout=5)


def test_preprocess_uses_threads_above_the_threshold_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    still_patches = image_module._still_patches

    def spy(image: Image.Image, height: int, width: int, settings: ImageSettings, threads: int) -> torch.Tensor:
        calls.append(threads)
        return still_patches(image, height, width, settings, threads)

    monkeypatch.setattr(image_module, "_still_patches", spy)
    rng = np.random.default_rng(6)
    settings = ImageSettings(threads_per_image=3, threaded_min_pixels=100_000)
    preprocess_image(_random_image(rng, 300, 300), settings)  # 90,000 -> 308x308 = 94,864 pixels
    preprocess_image(_random_image(rng, 400, 300), settings)  # 120,000 -> 392x308
    preprocess_image(_random_image(rng, 392, 308), settings)  # 120,736, no resize: banded patch layout only
    assert calls == [1, 3, 3]


def _collect_bands(image: Image.Image, width: int, height: int) -> tuple[list[tuple[int, ...]], np.ndarray]:
    boxes: list[tuple[int, ...]] = []
    out = np.zeros((height, width, 3), dtype=np.uint8)

    def sink(corner: tuple[int, int], pixels: np.ndarray) -> None:
        (x, y), (h, w) = corner, pixels.shape[:2]
        boxes.append((x, y, h, w))
        out[y : y + h, x : x + w] = pixels

    resize_bicubic_into(image, width, height, 3, sink, align=28)
    return boxes, out


def test_bands_of_the_last_pass_are_whole_blocks() -> None:
    # The image path lays out patches per band, so every band handed over must be whole 28-px blocks.
    rng = np.random.default_rng(8)
    for in_h, in_w, out_h, out_w in [
        (300, 500, 196, 364),
        (500, 300, 364, 196),
        (84, 1204, 84, 1204),
        (700, 90, 56, 28),
    ]:
        image = _random_image(rng, in_h, in_w)
        boxes, out = _collect_bands(image, out_w, out_h)
        assert len(boxes) > 1 or min(out_h, out_w) == 28
        assert all(v % 28 == 0 for box in boxes for v in box), boxes
        assert np.array_equal(out, _one_call(image, out_w, out_h)), (in_h, in_w, out_h, out_w)


@pytest.mark.parametrize(
    ("height", "width", "max_pixels"),
    [(480, 640, 200_704), (333, 517, 1_003_520), (700, 90, 50_000), (448, 336, 1_003_520), (84, 1204, 1_003_520)],
)
def test_threaded_path_matches_qwen2vl_image_processor(height: int, width: int, max_pixels: int) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    img = _random_image(np.random.default_rng(height + width), height, width)
    ref = Qwen2VLImageProcessorPil(max_pixels=max_pixels)(images=[img], return_tensors="pt")["pixel_values"]
    one = preprocess_image(img, ImageSettings(max_pixels=max_pixels, threads_per_image=1))
    for threads in (2, 3):
        ours = preprocess_image(
            img, ImageSettings(max_pixels=max_pixels, threads_per_image=threads, threaded_min_pixels=0)
        )
        assert torch.equal(ours.pixel_values, one.pixel_values) and torch.equal(ours.grid_thw, one.grid_thw)
    torch.testing.assert_close(one.pixel_values, ref.float(), atol=1e-5, rtol=0)


def test_threads_settings_are_validated() -> None:
    for bad in (0, 17):
        with pytest.raises(ValueError, match="threads_per_image"):
            ImageSettings(threads_per_image=bad)
    with pytest.raises(ValueError, match="threaded_min_pixels"):
        ImageSettings(threaded_min_pixels=-1)


@pytest.mark.parametrize(
    ("cpus", "asked", "workers", "expected"),
    [(2, 2, 2, 1), (2, 2, 1, 2), (8, 4, 2, 4), (8, 4, 3, 2), (16, 4, 2, 4), (4, 1, 1, 1), (2, 4, 8, 1)],
)
def test_loader_workers_share_the_cpus(
    monkeypatch: pytest.MonkeyPatch, cpus: int, asked: int, workers: int, expected: int
) -> None:
    # min(asked, max(1, cpus // workers)), hand-evaluated per row.
    monkeypatch.setattr(loader_module, "available_cpus", lambda: cpus)
    settings = ProcessorSettings(image=ImageSettings(threads_per_image=asked))
    got = worker_settings(settings, workers)
    assert got.image.threads_per_image == expected
    assert got.image.max_pixels == settings.image.max_pixels and got.video == settings.video
