"""Pillow's bicubic resize on several threads, bit for bit equal to one ``Image.resize`` call.

Pillow resizes 8-bit images in two separable passes over uint8 pixels (``ImagingResampleInner`` in its
``src/libImaging/Resample.c``). In the horizontal pass each output row is computed from the same input
row alone; in the vertical pass each output column from the same input column alone. A pass's filter
bounds and fixed-point coefficients depend only on its axis's (input size, box, output size). So each
pass splits exactly into bands that are resized by separate one-pass calls:

- horizontal pass: cut the rows into bands and resize each band to ``(out_w, band height)``. Its height
  is unchanged, so Pillow runs the horizontal pass only, with the coefficients of
  ``(in_w, box 0..in_w, out_w)``, those of the one-call resize;
- vertical pass: cut the columns into bands and resize each to ``(band width, out_h)``, a vertical-only
  pass with the coefficients of ``(in_h, box 0..in_h, out_h)``.

The two passes run in the order the one call runs them (`_vertical_first`), so every output pixel is
the same integer arithmetic on the same uint8 pixels with the same coefficients as in the one call. No
call passes a ``box`` offset, so no filter centre (``box0 + (i + 0.5) * scale``, computed in double
from a float32 box) is computed differently. Cutting the *output* rows into bands with ``box=`` does
change those centres in the last bits (for 10-25 % of the rows when in/out is not a dyadic fraction),
and then pixels now and then (measured: 480×640 → 364×504).

Pillow releases the GIL inside each pass, so the bands run in parallel (`relax_modalities._bands`).
`resize_bicubic_into` hands each band of the last pass to a callback on the thread that computed it,
so the image path lays out and normalises that band's patches there too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import PIL
from PIL import Image

from relax_modalities._bands import Band, bands, map_bands

_BICUBIC = Image.Resampling.BICUBIC
# Pillow 13.0 started choosing the pass order per call; 10.0-12.3 always run the horizontal pass first.
_PILLOW_PICKS_ORDER = int(PIL.__version__.split(".")[0]) >= 13


Sink = Callable[[tuple[int, int], np.ndarray], None]
"""Takes one band of the output: its top-left corner ``(x, y)`` and its pixels ``[h, w, 3]`` uint8."""


def resize_bicubic(image: Image.Image, width: int, height: int, threads: int) -> np.ndarray:
    """``np.asarray(image.resize((width, height), BICUBIC))``, each pass cut into ``threads`` bands.

    Equal bit for bit to the one call (see the module docstring); ``threads=1`` is that call.

    Args:
        image: an RGB PIL image (other modes are resized in one call).
        width: output width.
        height: output height.
        threads: bands per pass, one per thread (the calling thread runs one).

    Returns:
        ``[height, width, 3]`` uint8.
    """
    out = np.empty((height, width, 3), dtype=np.uint8)

    def write(corner: tuple[int, int], pixels: np.ndarray) -> None:
        x, y = corner
        out[y : y + pixels.shape[0], x : x + pixels.shape[1]] = pixels

    resize_bicubic_into(image, width, height, threads, write)
    return out


def resize_bicubic_into(image: Image.Image, width: int, height: int, threads: int, sink: Sink, align: int = 1) -> None:
    """`resize_bicubic`, handing each band of the last pass to ``sink`` on the thread that computed it.

    The output bands are cut at multiples of ``align`` along their axis (rows or columns), so a caller
    can process whole blocks of each band on that thread (e.g. lay out patches) with no further
    hand-off. Without a resize (same size) the image itself is handed over in row bands; with
    ``threads=1`` (or a mode other than RGB) it is handed over whole from one ``Image.resize`` call.
    """
    in_w, in_h = image.size
    if threads <= 1 or image.mode != "RGB":
        resized = image.resize((width, height), resample=_BICUBIC) if (in_w, in_h) != (width, height) else image
        sink((0, 0), np.asarray(resized))
        return
    passes = [_Pass(horizontal=True, size=width), _Pass(horizontal=False, size=height)]
    if _vertical_first(in_w, in_h, width, height):
        passes.reverse()
    passes = [p for p in passes if p.size != (in_w if p.horizontal else in_h)]  # Pillow skips a no-op pass too
    if not passes:
        pixels = np.asarray(image)
        map_bands(lambda rows: sink((0, rows[0]), pixels[rows[0] : rows[1]]), bands(in_h, threads, align))
        return
    tiles: list[_Tile] = [((0, 0), image)]
    for i, p in enumerate(passes):
        last = i == len(passes) - 1
        tiles = p.run(tiles, threads, sink if last else None, align if last else 1)


def _vertical_first(in_w: int, in_h: int, out_w: int, out_h: int) -> bool:
    """Whether one ``Image.resize`` call runs the vertical pass first.

    Pillow 13.0's rule (``ImagingResampleInner``): when the height shrinks by more than twice as many
    pixels as the width does. The order matters: the intermediate image is rounded to uint8.
    """
    shrink_h, shrink_w = in_h - out_h, in_w - out_w
    return _PILLOW_PICKS_ORDER and shrink_h > 0 and shrink_h > 2 * shrink_w


# A piece of an image: (its top-left corner (x, y) in the whole image, the piece).
_Tile = tuple[tuple[int, int], Image.Image]


@dataclass(frozen=True)
class _Pass:
    """One resampling pass: horizontal (the width becomes ``size``) or vertical (the height does).

    It is cut into bands along the axis it keeps: row bands for a horizontal pass, column bands for a
    vertical one, so that each band is one single-pass ``Image.resize`` call.
    """

    horizontal: bool
    size: int

    def run(self, tiles: Sequence[_Tile], threads: int, sink: Sink | None, align: int) -> list[_Tile]:
        """Resample the image ``tiles`` cover, in bands cut at multiples of ``align``.

        Each band gathers its own input from ``tiles`` (and hands its output to ``sink``, if given),
        so these copies run in parallel too rather than as a serial assemble step between passes.
        """
        w = max(x + t.width for (x, _), t in tiles)
        h = max(y + t.height for (_, y), t in tiles)

        def band(span: Band) -> _Tile:
            a, b = span
            if self.horizontal:
                box, size, corner = (0, a, w, b), (self.size, b - a), (0, a)
            else:
                box, size, corner = (a, 0, b, h), (b - a, self.size), (a, 0)
            resized = _region(tiles, box).resize(size, _BICUBIC)
            if sink is not None:
                sink(corner, np.asarray(resized))
            return corner, resized

        return map_bands(band, bands(h if self.horizontal else w, threads, align))


def _region(tiles: Sequence[_Tile], box: tuple[int, int, int, int]) -> Image.Image:
    """The ``box`` (left, top, right, bottom) of the image that ``tiles`` cover, as a new image."""
    left, top, right, bottom = box
    if len(tiles) == 1:
        return tiles[0][1].crop(box)
    region = Image.new("RGB", (right - left, bottom - top))
    for (x, y), t in tiles:
        if x < right and y < bottom and x + t.width > left and y + t.height > top:
            region.paste(t, (x - left, y - top))  # Pillow clips what falls outside the region
    return region
