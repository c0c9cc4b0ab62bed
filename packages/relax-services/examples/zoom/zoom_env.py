"""Zoom: the answer is only visible in a crop that the environment returns as an image in the second turn.

A picture of four 56 × 56 regions, numbered 1-4 in reading order: the region a row names is filled with one of four
colours, coded 1-4 (red, green, blue, yellow), the others are grey. The first observation names the region ("zoom
3") and shows no picture. The model's first turn names the region it zooms into; the environment answers with that
region's crop (an image part: 4 vision tokens of the default tiny model; grey for another region or a reply that is
no region). The model's second turn names the colour's code; the reward is 1 when it is right. A policy that ignores
the image is right 1 time in 4. Codes are digits, like the regions, so that the format warm-up (one option and the
eos, ``extra_info.options``) teaches the form of both turns. (A first version coloured every region: a crop of the
wrong region then showed a wrong colour, so reading the crop was punished 3 times in 4 until zooming was learned,
and zooming paid nothing until reading was: 370 updates stayed at chance.)

Departure from a tool set: the default tiny tokenizer cannot write Qwen's ``<tool_call>{"name": ...}`` (it has no
``<``, ``{`` or ``"``), so the zoom is the environment's ``step`` answer to the first turn; with a checkpoint whose
tokenizer can write tool calls, the same crop is a tool: ``def zoom(self, region: Literal["1", "2", "3", "4"]) ->
dict`` returning ``{"type": "image", "image": self.crop(region)}``.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

COLOURS: dict[str, tuple[int, int, int]] = {
    "1": (220, 40, 40),
    "2": (40, 190, 60),
    "3": (40, 70, 220),
    "4": (230, 220, 40),
}
"""Colour code → RGB: red, green, blue, yellow."""
SIDE = 56
"""One region's side in pixels: 4 vision tokens of the default tiny model (patch 14, merge 2)."""


GREY = (128, 128, 128)


def picture(colour: str, region: int, seed: int) -> np.ndarray:
    """``[112, 112, 3]`` uint8: region ``region`` (1-4, reading order) filled with colour ``colour``, the others grey,
    plus pixel noise."""
    rng = np.random.default_rng(seed)
    img = np.zeros((2 * SIDE, 2 * SIDE, 3), dtype=np.int16)
    for i in range(4):
        row, col = divmod(i, 2)
        img[row * SIDE : (row + 1) * SIDE, col * SIDE : (col + 1) * SIDE] = COLOURS[colour] if i + 1 == region else GREY
    img += rng.integers(-12, 13, size=img.shape, dtype=np.int16)
    return np.clip(img, 0, 255).astype(np.uint8)


class Zoom:
    """One episode: ``reset`` names the region, ``step`` answers the first turn with the crop, the second turn is the
    answer."""

    modalities = ("image",)

    def reset(self, row):
        info = row["extra_info"]
        self.region, self.seed, self.answer = int(info["region"]), int(info["seed"]), row["answer"]
        self.turn, self.last = 0, ""
        return [{"role": "user", "content": f"zoom {info['region']}"}]

    def crop(self, region: str) -> bytes:
        """PNG bytes of region ``region``'s crop (a grey one for a region that does not exist)."""
        if region in ("1", "2", "3", "4"):
            row, col = divmod(int(region) - 1, 2)
            whole = picture(self.answer, self.region, self.seed)
            pixels = whole[row * SIDE : (row + 1) * SIDE, col * SIDE : (col + 1) * SIDE]
        else:
            pixels = np.full((SIDE, SIDE, 3), GREY, dtype=np.uint8)
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, format="PNG")
        return out.getvalue()

    def step(self, assistant_message):
        self.turn += 1
        text = str(assistant_message["content"]).strip()
        if self.turn == 1:
            parts = [{"type": "image", "image": self.crop(text)}, {"type": "text", "text": "colour?"}]
            return [{"role": "user", "content": parts}], None, False
        self.last = text
        return [], None, True

    def reward(self) -> float:
        return float(self.last == self.answer)
