"""Synthetic omni tasks written as real files (PNG/JPEG, WAV/FLAC, MP4) plus a JSONL manifest.

Every task is learnable by a ≈ 0.4 M-parameter thinker with RL from scratch on CPU: objects fill the
28-px block one vision token covers, tones last 1 s (25 audio tokens), prompts and answers use only
tiny-vocabulary characters. Each item is generated from its own RNG stream ``(seed, task, index)``,
so output does not depend on which tasks are generated together or in what order.
"""

from __future__ import annotations

import fractions
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import soundfile as sf
from PIL import Image

from relax_modalities.synthetic._manifest import MediaRef, TaskItem, write_manifest

TASKS: tuple[str, ...] = ("image", "audio", "video", "text", "audio_video")
"""Task names, in the default generation order."""

_TASK_SEED = {name: i for i, name in enumerate(TASKS)}
_COLOURS: dict[str, tuple[int, int, int]] = {
    "r": (220, 30, 30),
    "g": (30, 200, 40),
    "b": (30, 60, 230),
    "y": (230, 220, 30),
    "m": (210, 40, 210),
    "c": (40, 210, 220),
}
_DIRECTIONS: dict[str, tuple[int, int]] = {"l": (0, -1), "r": (0, 1), "u": (-1, 0), "d": (1, 0)}  # (dy, dx)
SQUARE = 28  # one vision token (patch 14 × merge 2) per side
AUDIO_RATE = 16_000


def _rng(seed: int, task: str, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, _TASK_SEED[task], index])


# ---------------------------------------------------------------- image: which colour
def _image_options(difficulty: int) -> str:
    return "rg" if difficulty <= 0 else ("rgby" if difficulty <= 2 else "rgbymc")


def _make_image(rng: np.random.Generator, difficulty: int) -> tuple[np.ndarray, str]:
    options = _image_options(difficulty)
    answer = options[rng.integers(len(options))]
    side = 112 if difficulty >= 3 else 56
    colour = np.array(_COLOURS[answer], dtype=np.int16)
    if difficulty <= 1:  # the colour fills the image
        img = np.broadcast_to(colour, (side, side, 3)).copy()
    else:  # a 28-px block on a grey noisy background, aligned to the token grid
        img = rng.integers(90, 160, size=(side, side, 1), dtype=np.int16).repeat(3, axis=2)
        by, bx = (rng.integers(side // SQUARE, size=2) * SQUARE).tolist()
        img[by : by + SQUARE, bx : bx + SQUARE] = colour
    img = img + rng.integers(-12, 13, size=img.shape, dtype=np.int16)
    return np.clip(img, 0, 255).astype(np.uint8), answer


def _image_item(out: Path, seed: int, i: int, difficulty: int) -> TaskItem:
    rng = _rng(seed, "image", i)
    img, answer = _make_image(rng, difficulty)
    options = _image_options(difficulty)
    path = out / "media" / "image" / (f"{i:06d}.png" if i % 2 == 0 else f"{i:06d}.jpg")
    Image.fromarray(img).save(path, quality=95) if path.suffix == ".jpg" else Image.fromarray(img).save(path)
    return TaskItem(
        id=f"image-{i}",
        task="image",
        prompt="which colour? " + " ".join(options),
        media=(MediaRef("image", str(path)),),
        answer=answer,
        options=tuple(options),
        chance=1.0 / len(options),
        difficulty=difficulty,
    )


# ---------------------------------------------------------------- audio: which pitch
def _pitch_table(difficulty: int) -> tuple[tuple[str, ...], tuple[float, ...]]:
    if difficulty <= 0:
        return ("l", "h"), (250.0, 2000.0)
    if difficulty == 1:
        return ("1", "2", "3"), (250.0, 700.0, 2000.0)
    return ("1", "2", "3", "4"), (250.0, 500.0, 1000.0, 2000.0)


def _tone(rng: np.random.Generator, freq: float, rate: int, difficulty: int) -> np.ndarray:
    t = np.arange(rate, dtype=np.float64) / rate  # 1 s
    f = freq * rng.uniform(0.95, 1.05)
    amp = rng.uniform(0.3, 0.7)
    noise = 0.02 if difficulty <= 1 else 0.1
    x = amp * np.sin(2 * np.pi * f * t + rng.uniform(0, 2 * np.pi)) + noise * rng.standard_normal(len(t))
    return np.clip(x, -1, 1).astype(np.float32)


def _pitch_answer(rng: np.random.Generator, difficulty: int) -> tuple[str, float]:
    names, freqs = _pitch_table(difficulty)
    k = int(rng.integers(len(names)))
    return names[k], freqs[k]


def _audio_item(out: Path, seed: int, i: int, difficulty: int) -> TaskItem:
    rng = _rng(seed, "audio", i)
    answer, freq = _pitch_answer(rng, difficulty)
    # Even items: 16 kHz WAV; odd items: 24 kHz FLAC, which exercises decoding and resampling.
    wav = i % 2 == 0
    rate = AUDIO_RATE if wav else 24_000
    path = out / "media" / "audio" / (f"{i:06d}.wav" if wav else f"{i:06d}.flac")
    sf.write(path, _tone(rng, freq, rate, difficulty), rate, subtype="PCM_16")
    names, _ = _pitch_table(difficulty)
    return TaskItem(
        id=f"audio-{i}",
        task="audio",
        prompt="pitch? " + " ".join(names),
        media=(MediaRef("audio", str(path)),),
        answer=answer,
        options=names,
        chance=1.0 / len(names),
        difficulty=difficulty,
    )


# ---------------------------------------------------------------- video: which way the square moves
def _make_frames(rng: np.random.Generator, difficulty: int, frames: int = 4) -> tuple[np.ndarray, str]:
    side = (56, 84, 112)[min(max(difficulty, 0), 2)]
    answer = "lrud"[int(rng.integers(4))]
    dy, dx = _DIRECTIONS[answer]
    bg = rng.integers(0, 80, size=3)
    fg = rng.integers(170, 256, size=3)
    across = int(rng.integers(0, side - SQUARE + 1))  # position on the axis it does not move along
    steps = np.linspace(0, side - SQUARE, frames).round().astype(int)
    if dy < 0 or dx < 0:
        steps = steps[::-1]
    video = np.empty((frames, side, side, 3), dtype=np.uint8)
    for k, s in enumerate(steps):
        y, x = (s, across) if dy != 0 else (across, s)
        video[k] = bg
        video[k, y : y + SQUARE, x : x + SQUARE] = fg
    return video, answer


def write_mp4(path: str | os.PathLike[str], frames: np.ndarray, fps: int, audio: np.ndarray | None = None) -> None:
    """Encode ``[T, H, W, 3]`` uint8 frames (H.264, no B-frames) and optional 16 kHz mono audio (AAC)."""
    import av

    with av.open(str(path), "w") as c:
        vs = c.add_stream("libx264", rate=fps)
        vs.width, vs.height = frames.shape[2], frames.shape[1]
        vs.pix_fmt = "yuv420p"
        vs.options = {"preset": "ultrafast", "tune": "zerolatency", "crf": "12"}
        astream = None
        if audio is not None:
            astream = c.add_stream("aac", rate=AUDIO_RATE)
            astream.layout = "mono"
        for f in frames:
            c.mux(vs.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")))
        c.mux(vs.encode(None))
        if astream is not None and audio is not None:
            step = 1024  # AAC frame size
            for s in range(0, len(audio), step):
                fr = av.AudioFrame.from_ndarray(audio[None, s : s + step], format="fltp", layout="mono")
                fr.sample_rate, fr.pts, fr.time_base = AUDIO_RATE, s, fractions.Fraction(1, AUDIO_RATE)
                c.mux(astream.encode(fr))
            c.mux(astream.encode(None))


def _video_item(out: Path, seed: int, i: int, difficulty: int) -> TaskItem:
    rng = _rng(seed, "video", i)
    frames, answer = _make_frames(rng, difficulty)
    path = out / "media" / "video" / f"{i:06d}.mp4"
    write_mp4(path, frames, fps=4)
    return TaskItem(
        id=f"video-{i}",
        task="video",
        prompt="move? l r u d",
        media=(MediaRef("video", str(path)),),
        answer=answer,
        options=tuple("lrud"),
        chance=0.25,
        difficulty=difficulty,
    )


# ---------------------------------------------------------------- text: single-digit addition
def _text_item(out: Path, seed: int, i: int, difficulty: int) -> TaskItem:
    rng = _rng(seed, "text", i)
    top = 9 if difficulty <= 0 else 18  # level 0: the sum is a single digit
    # The sum is drawn uniformly, so no answer is more frequent than another and always giving the most
    # common answer scores exactly the chance level; then a uniformly among the digits that reach it.
    total = int(rng.integers(0, top + 1))
    a = int(rng.integers(max(0, total - 9), min(9, total) + 1))
    b = total - a
    options = tuple(str(k) for k in range(top + 1))
    return TaskItem(
        id=f"text-{i}",
        task="text",
        prompt=f"{a}+{b}=",
        answer=str(a + b),
        options=options,
        chance=1.0 / len(options),
        difficulty=difficulty,
    )


# ---------------------------------------------------------------- audio + video: direction and pitch
def _audio_video_item(out: Path, seed: int, i: int, difficulty: int) -> TaskItem:
    rng = _rng(seed, "audio_video", i)
    frames, direction = _make_frames(rng, difficulty)
    pitch, freq = _pitch_answer(rng, 0)
    path = out / "media" / "audio_video" / f"{i:06d}.mp4"
    write_mp4(path, frames, fps=4, audio=_tone(rng, freq, AUDIO_RATE, difficulty))
    options = tuple(d + p for d in "lrud" for p in "lh")
    return TaskItem(
        id=f"audio_video-{i}",
        task="audio_video",
        prompt="move and pitch?",
        media=(MediaRef("video", str(path), audio_track=True),),
        answer=direction + pitch,
        options=options,
        chance=1.0 / len(options),
        difficulty=difficulty,
    )


_GENERATORS: dict[str, Callable[[Path, int, int, int], TaskItem]] = {
    "image": _image_item,
    "audio": _audio_item,
    "video": _video_item,
    "text": _text_item,
    "audio_video": _audio_video_item,
}


def write_synthetic_tasks(
    out_dir: str | os.PathLike[str],
    tasks: Sequence[str] = TASKS,
    n_per_task: int = 64,
    seed: int = 0,
    difficulty: int = 0,
) -> Path:
    """Generate ``n_per_task`` items of each task as real files under ``out_dir`` and a manifest.

    Items are interleaved (item 0 of every task, then item 1, …). Same arguments, same bytes.

    Args:
        out_dir: directory to write ``manifest.jsonl`` and ``media/<task>/`` into.
        tasks: task names from `TASKS`.
        n_per_task: items per task.
        seed: base seed.
        difficulty: 0 (easiest) and up; see each task's generator.

    Returns:
        Path of ``manifest.jsonl``.

    Raises:
        ValueError: for an unknown task name or a negative ``n_per_task``.
    """
    unknown = [t for t in tasks if t not in _GENERATORS]
    if unknown:
        raise ValueError(f"unknown synthetic task(s) {unknown}; choose from {list(_GENERATORS)}")
    if n_per_task < 0:
        raise ValueError(f"n_per_task must be >= 0, got {n_per_task}")
    out = Path(out_dir).resolve()
    for t in tasks:
        (out / "media" / t).mkdir(parents=True, exist_ok=True)
    items = [_GENERATORS[t](out, seed, i, difficulty) for i in range(n_per_task) for t in tasks]
    return write_manifest(items, out / "manifest.jsonl")
