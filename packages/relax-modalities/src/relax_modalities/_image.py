"""Image path: decode (EXIF, RGB), smart resize, normalise, patchify into Qwen2-VL's layout."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from relax_modalities._bands import MAX_THREADS_PER_IMAGE, available_cpus
from relax_modalities._errors import MediaError, check_readable
from relax_modalities._resize import resize_bicubic_into

OPENAI_CLIP_MEAN: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)

# EXIF orientations 5..8 rotate by 90°/270°, which swaps width and height.
_EXIF_ORIENTATION = 0x0112
_SWAPS_AXES = {5, 6, 7, 8}

MAX_ASPECT_RATIO = 200
"""The vision encoder's limit on long side / short side (Qwen2-VL's ``smart_resize``)."""

THREADED_MIN_PIXELS = 100_000
"""Default `ImageSettings.threaded_min_pixels`."""


def default_threads_per_image() -> int:
    """``min(4, CPUs this process may run on)``: beyond 4 bands the copies and hand-offs eat the gain."""
    return min(4, available_cpus())


@dataclass(frozen=True)
class ImageSettings:
    """How images become vision-encoder patches (defaults are Qwen2-VL / Qwen2.5-Omni's).

    Attributes:
        patch_size: spatial patch side in pixels.
        merge_size: patches merged per side into one LLM token (2 → 2×2 patches per token).
        temporal_patch_size: frames per temporal patch; a still image is repeated this many times.
        min_pixels: lower bound on resized height × width.
        max_pixels: upper bound on resized height × width.
        image_mean: per-channel mean subtracted after scaling to [0, 1].
        image_std: per-channel std divided by after subtracting the mean.
        max_decoded_pixels: header-declared width × height above which a file is rejected as a
            decompression bomb before any pixel is decoded.
        threads_per_image: threads working on one image (1 to 16; 1 is one thread): each bicubic
            resize pass is cut into this many bands (equal bit for bit to one ``Image.resize`` call),
            and each band of the last pass is laid out into patches and normalised on its thread.
            Default ``min(4, CPUs this process may run on)``; `build_loader` lowers it so that its
            decode workers together do not run more threads than CPUs.
        threaded_min_pixels: an image with fewer pixels (source or target, whichever is larger) is
            processed on one thread: below it, the band copies and the hand-off to another thread
            cost more than they save (measured in docs/modalities.md's benchmark section).
    """

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    max_decoded_pixels: int = 64_000_000
    threads_per_image: int = field(default_factory=default_threads_per_image)
    threaded_min_pixels: int = THREADED_MIN_PIXELS

    def __post_init__(self) -> None:
        for name in ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_decoded_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"ImageSettings.{name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.threads_per_image <= MAX_THREADS_PER_IMAGE:
            raise ValueError(
                f"ImageSettings.threads_per_image must be in [1, {MAX_THREADS_PER_IMAGE}], got {self.threads_per_image}"
            )
        if self.threaded_min_pixels < 0:
            raise ValueError(f"ImageSettings.threaded_min_pixels must be >= 0, got {self.threaded_min_pixels}")
        if self.max_pixels < self.min_pixels:
            raise ValueError(f"ImageSettings.max_pixels ({self.max_pixels}) must be >= min_pixels ({self.min_pixels})")
        if self.max_pixels < self.factor**2:
            raise ValueError(f"ImageSettings.max_pixels must be >= (patch_size*merge_size)**2 = {self.factor**2}")

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this (``patch_size * merge_size``)."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch: ``3 * temporal_patch_size * patch_size**2``."""
        return 3 * self.temporal_patch_size * self.patch_size**2


@dataclass
class ImageFeatures:
    """One image as the vision encoder takes it.

    Attributes:
        pixel_values: ``[grid_h * grid_w, 3 * temporal_patch * patch**2]`` float32 patches.
        grid_thw: ``[3]`` int64 ``(1, grid_h, grid_w)`` in patches.
        num_tokens: LLM placeholder tokens, ``grid_h * grid_w // merge**2``.
    """

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    num_tokens: int


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Target size with both sides multiples of ``factor``, area in [min_pixels, max_pixels], aspect kept.

    Round each side to the nearest multiple; if the area is too large, scale both sides down by
    ``sqrt(area / max_pixels)`` and floor to multiples; if too small, scale up and ceil.

    Raises:
        ValueError: for an aspect ratio above 200 (the vision encoder's limit).
    """
    if min(height, width) < 1:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"absolute aspect ratio must be at most {MAX_ASPECT_RATIO}, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_token_count(height: int, width: int, settings: ImageSettings) -> int:
    """Placeholder tokens an image of ``height × width`` (after EXIF rotation) will take."""
    h, w = smart_resize(height, width, settings.factor, settings.min_pixels, settings.max_pixels)
    return (h // settings.factor) * (w // settings.factor)


@contextmanager
def _opened(path: str | os.PathLike[str], settings: ImageSettings) -> Iterator[tuple[Path, Image.Image]]:
    """The image at ``path``, header read, on a file this function owns and closes on exit.

    Pillow reads from our file object and leaves closing it to us, so an image loaded inside the
    block stays usable after it (no ``Image.close``, no copy to outlive it).
    """
    p = check_readable(path, "image")
    with ExitStack() as stack:
        try:
            fp = stack.enter_context(open(p, "rb"))
        except OSError as exc:
            raise MediaError(p, "image", f"cannot open: {exc}") from exc
        yield p, _open_checked(p, fp, settings)


def _open_checked(p: Path, fp: BinaryIO, settings: ImageSettings) -> Image.Image:
    try:
        # Pillow warns above its own limit (Image.MAX_IMAGE_PIXELS) and raises at twice it; our
        # max_decoded_pixels check below is the policy. No warnings.catch_warnings here: it is not
        # thread-safe and the loader decodes in threads; where warnings are errors we catch it.
        img = Image.open(fp)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise MediaError(p, "image", f"decompression bomb: {exc}") from exc
    except UnidentifiedImageError as exc:
        raise MediaError(p, "image", "not a recognised image format") from exc
    except OSError as exc:
        raise MediaError(p, "image", f"cannot open: {exc}") from exc
    w, h = img.size
    if w * h > settings.max_decoded_pixels:
        raise MediaError(
            p,
            "image",
            f"decompression bomb: {w}x{h} = {w * h} pixels exceeds max_decoded_pixels {settings.max_decoded_pixels}",
        )
    if max(w, h) > MAX_ASPECT_RATIO * min(w, h):  # known from the header: reject before decoding
        raise MediaError(
            p,
            "image",
            f"aspect ratio too large: {w}x{h} is {max(w, h) / min(w, h):.0f}:1, at most {MAX_ASPECT_RATIO}:1",
        )
    return img


def probe_image_size(path: str | os.PathLike[str], settings: ImageSettings | None = None) -> tuple[int, int]:
    """``(height, width)`` after EXIF rotation, read from the header only (no pixel decode)."""
    settings = settings or ImageSettings()
    with _opened(path, settings) as (_, img):
        w, h = img.size
        orientation = img.getexif().get(_EXIF_ORIENTATION, 1)
    return (w, h) if orientation in _SWAPS_AXES else (h, w)


def load_image(path: str | os.PathLike[str], settings: ImageSettings | None = None) -> Image.Image:
    """Decode an image file to an RGB PIL image with EXIF orientation applied.

    Raises:
        MediaError: missing, empty, truncated, corrupt, unknown-format or oversized file.
    """
    settings = settings or ImageSettings()
    with _opened(path, settings) as (p, img):
        try:
            img.load()
            # In place: without an orientation tag this is a no-op, where the copying form would
            # duplicate the whole decoded image.
            ImageOps.exif_transpose(img, in_place=True)
            return to_rgb(img)
        except Exception as exc:  # Pillow raises OSError, SyntaxError, ValueError … for broken data
            raise MediaError(p, "image", f"decode failed ({type(exc).__name__}: {exc})") from exc


_WIDE_GREY_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")


def to_rgb(img: Image.Image) -> Image.Image:
    """RGB copy of ``img``; transparent pixels are composited over white (as transformers does).

    16-bit greyscale (Pillow's ``I;16`` modes, and ``I`` as Pillow opens some 16-bit PNGs) is scaled
    to 8 bits first, ``round(v · 255 / 65535)``: Pillow's own conversion clips every value above 255
    to white (a 16-bit PNG came out 99.8 % white). ``I`` values outside [0, 65535] are clipped.
    """
    if img.mode == "RGB":
        return img
    if img.mode in _WIDE_GREY_MODES:
        wide = np.asarray(img, dtype=np.float32)  # [H, W]; 65535 fits float32 exactly
        grey = np.rint(np.clip(wide, 0.0, 65535.0) * (255.0 / 65535.0)).astype(np.uint8)
        return Image.fromarray(grey).convert("RGB")
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def normalisation_affine(settings: ImageSettings) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel ``(scale, offset)`` so that ``u8 * scale + offset == (u8 / 255 - mean) / std``."""
    std = np.asarray(settings.image_std, dtype=np.float64)
    mean = np.asarray(settings.image_mean, dtype=np.float64)
    return (1.0 / (255.0 * std)).astype(np.float32), (-mean / std).astype(np.float32)


def patchify_frames(frames: np.ndarray, settings: ImageSettings) -> np.ndarray:
    """Normalise and patchify uint8 frames into the Qwen2-VL flat patch layout.

    Args:
        frames: ``[T, H, W, 3]`` uint8, ``T`` a multiple of ``temporal_patch_size``, ``H`` and ``W``
            multiples of ``patch_size * merge_size``.
        settings: patch geometry and normalisation.

    Returns:
        ``[T/tp * H/p * W/p, 3 * tp * p * p]`` float32; rows ordered (t, h-block, w-block, h-in-block,
        w-in-block), columns (channel, t-in-patch, y, x).
    """
    u8 = _patch_order(frames, settings.temporal_patch_size, settings)
    return _normalise(u8, settings).numpy()


def _patch_order(frames: np.ndarray, group: int, settings: ImageSettings) -> np.ndarray:
    """Reorder uint8 pixels ``[T, H, W, C]`` into patches ``[T/group * H/p * W/p, C, group, p*p]``.

    The reorder is done on 1-byte pixels, before anything is widened to float32.
    """
    t, h, w, c = frames.shape
    p, m = settings.patch_size, settings.merge_size
    gh, gw = h // p, w // p
    x = frames.reshape(t // group, group, gh // m, m, p, gw // m, m, p, c)
    x = x.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)  # [T/group, gh/m, gw/m, m, m, C, group, p, p]
    return np.ascontiguousarray(x).reshape(t // group * gh * gw, c, group, p * p)


def _normalise(u8: np.ndarray, settings: ImageSettings) -> torch.Tensor:
    """``[N, C, k, p*p]`` uint8 patches (``k`` is 1 or ``tp``) → ``[N, C * tp * p*p]`` float32, normalised.

    ``k == 1`` is a still image: its one frame is normalised once and written ``tp`` times, in numpy,
    whose per-call cost is lower than torch's dispatch (which dominates on small images). ``k == tp``
    is ``tp`` distinct frames (video): one widening copy into the output and the per-channel affine
    in place, in torch, whose uint8→float32 copy and broadcast multiply are vectorised (2-3× numpy's
    on a video's tens of MB; torch runs them on its intra-op threads, which the benchmark pins to
    one). Either way the output is allocated by numpy, which asks the kernel for huge pages on large
    arrays (torch.empty does not: about 50× the page faults on a fresh photo-sized output).
    """
    n, c, k, pp = u8.shape
    tp = settings.temporal_patch_size
    out = np.empty((n, c, tp, pp), dtype=np.float32)
    if k == 1:
        _normalise_still(u8, out, settings)
    else:
        scale, offset = normalisation_affine(settings)
        t = torch.from_numpy(out)
        t.copy_(torch.from_numpy(u8))
        t.mul_(torch.from_numpy(scale[:, None, None])).add_(torch.from_numpy(offset[:, None, None]))
    return torch.from_numpy(out.reshape(n, c * tp * pp))


def _normalise_still(u8: np.ndarray, out: np.ndarray, settings: ImageSettings) -> None:
    """``[..., C, 1, p*p]`` uint8 patches of one frame → ``out`` ``[..., C, tp, p*p]`` float32, written tp times."""
    scale, offset = normalisation_affine(settings)
    frame = np.multiply(u8, scale[:, None, None], dtype=np.float32)  # [N, C, 1, p*p]
    frame += offset[:, None, None]
    out[...] = frame


def _still_patches(image: Image.Image, height: int, width: int, settings: ImageSettings, threads: int) -> torch.Tensor:
    """``image`` resized to ``height × width`` → ``[H/p * W/p, 3 * tp * p*p]`` float32 patches, normalised.

    A still image is one frame repeated tp times: it is reordered once and repeated while normalised.
    With several threads the resize's last pass is cut into bands of whole merged blocks (``factor``
    pixels), and each band is laid out and normalised on the thread that resized it, straight into its
    patches (numpy releases the GIL in both).
    """
    if threads == 1:  # most images in a loader: the plain path, without the bands' few µs of bookkeeping
        if image.size != (width, height):
            image = image.resize((width, height), resample=Image.Resampling.BICUBIC)
        return _normalise(_patch_order(np.asarray(image)[None], 1, settings), settings)
    f, p, m = settings.factor, settings.patch_size, settings.merge_size
    c, tp = 3, settings.temporal_patch_size
    out = np.empty((height // p * (width // p), c, tp, p * p), dtype=np.float32)
    per_block_row = width // p * m  # patches in one row of merged blocks

    def patchify(corner: tuple[int, int], pixels: np.ndarray) -> None:  # pixels: [h, w, 3], whole blocks
        (x, y), (h, w) = corner, pixels.shape[:2]
        u8 = _patch_order(pixels[None], 1, settings)  # [h/p * w/p, C, 1, p*p]
        if w == width:  # whole rows of blocks: a contiguous run of patches
            _normalise_still(u8, out[y // f * per_block_row : (y + h) // f * per_block_row], settings)
        else:  # a column band: its blocks are a strided part of every row of blocks
            blocks = out.reshape(height // f, width // f, m * m, c, tp, p * p)
            dst = blocks[y // f : (y + h) // f, x // f : (x + w) // f]
            _normalise_still(u8.reshape(h // f, w // f, m * m, c, 1, p * p), dst, settings)

    resize_bicubic_into(image, width, height, threads, patchify, align=f)
    return torch.from_numpy(out.reshape(out.shape[0], -1))


def preprocess_image(image: Image.Image, settings: ImageSettings | None = None) -> ImageFeatures:
    """Resize (bicubic) to patch multiples within the pixel budget, normalise and patchify one image.

    Equal (to 1e-5) to transformers' ``Qwen2VLImageProcessor`` with the same settings, and bit for bit
    the same for any ``threads_per_image``.

    Args:
        image: an RGB PIL image (`load_image` gives one).
        settings: geometry and normalisation.
    """
    settings = settings or ImageSettings()
    image = to_rgb(image)
    w, h = image.size
    rh, rw = smart_resize(h, w, settings.factor, settings.min_pixels, settings.max_pixels)
    threads = settings.threads_per_image if max(h * w, rh * rw) >= settings.threaded_min_pixels else 1
    patches = _still_patches(image, rh, rw, settings, threads)
    gh, gw = rh // settings.patch_size, rw // settings.patch_size
    return ImageFeatures(
        pixel_values=patches,
        grid_thw=torch.tensor([1, gh, gw], dtype=torch.long),
        num_tokens=gh * gw // settings.merge_size**2,
    )
