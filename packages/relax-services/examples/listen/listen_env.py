"""Listen: the answer is only audible in a segment that the environment returns as audio in the second turn.

A 2 s clip of four 0.5 s segments, numbered 1-4 in time order: the segment a row names carries a tone of one of four
pitches, coded 1-4 (250, 500, 1000 and 2000 Hz, each within ±5 %: the synthetic audio task's four-pitch table, an
octave apart, 12-23 log-mel bins apart in the default tiny model's 128), the others only the faint noise that lies
under the whole clip. The first observation names the segment ("listen 3") and plays nothing. The model's first turn
names the segment it listens to; the environment answers with that segment's audio (an audio part of WAV bytes: 0.5
s at 16 kHz are 50 feature frames, 12 audio tokens of the default tiny model; noise only for another segment). The
model's second turn names the pitch's code; the reward is 1 when it is right. A reply that names no segment ends the
episode unanswered (reward 0). A policy that ignores the audio is right 1 time in 4. Codes are digits, like the
segments, so that the format warm-up (one option and the eos, ``extra_info.options``) teaches the form of both
turns.

Kept from the zoom example's first version (``examples/zoom/zoom_env.py``): only the named segment carries a tone.
Had every segment a tone, a wrong segment would play a wrong pitch, so reading the audio would be punished 3 times in
4 until the right segment was asked for, and asking for it would pay nothing until reading was learned: the zoom
example's version of that stayed at chance for 370 updates. Here a wrong listen plays noise, which says nothing.
A first version also played noise for a reply that named no segment: while the reward did not yet depend on the
first turn, it drifted to an empty reply (the eos alone) in all but 3 of 256 sampled episodes by update 250, so no
episode heard the tone and 289 updates (8 min) stayed at chance; ending such an episode at 0 keeps a segment named.

Departure from a tool set: the default tiny tokenizer cannot write Qwen's ``<tool_call>{"name": ...}`` (it has no
``<``, ``{`` or ``"``), so the listen is the environment's ``step`` answer to the first turn; with a checkpoint whose
tokenizer can write tool calls, the same segment is a tool: ``def listen(self, segment: Literal["1", "2", "3", "4"])
-> dict`` returning ``{"type": "audio", "audio": self.segment(segment)}``.
"""

from __future__ import annotations

import io

import numpy as np
import soundfile as sf

PITCHES: dict[str, float] = {"1": 250.0, "2": 500.0, "3": 1000.0, "4": 2000.0}
"""Pitch code → tone frequency in Hz (each drawn within ±5 % of it)."""
RATE = 16_000
"""Sample rate in Hz: the default tiny model's (Whisper features at 16 kHz), so no resampling."""
SEGMENT = RATE // 2
"""One segment's length in samples (0.5 s): 50 feature frames, 12 audio tokens of the default tiny model."""
NOISE = 0.02
"""Standard deviation of the noise under the whole clip (the synthetic audio task's at its easy levels)."""


def clip(pitch: str, segment: int, seed: int) -> np.ndarray:
    """``[4 * SEGMENT]`` float32 samples in [-1, 1]: noise throughout, and in segment ``segment`` (1-4, time order) a
    tone of pitch ``pitch`` whose frequency (±5 %), amplitude (0.3-0.7) and phase are drawn with ``seed``."""
    rng = np.random.default_rng(seed)
    x = NOISE * rng.standard_normal(4 * SEGMENT)
    f = PITCHES[pitch] * rng.uniform(0.95, 1.05)
    amp = rng.uniform(0.3, 0.7)
    t = np.arange(SEGMENT) / RATE
    start = (segment - 1) * SEGMENT
    x[start : start + SEGMENT] += amp * np.sin(2 * np.pi * f * t + rng.uniform(0, 2 * np.pi))
    return np.clip(x, -1, 1).astype(np.float32)


def wav_bytes(samples: np.ndarray) -> bytes:
    """16-bit PCM WAV bytes of ``samples`` at ``RATE``."""
    out = io.BytesIO()
    sf.write(out, samples, RATE, format="WAV", subtype="PCM_16")
    return out.getvalue()


class Listen:
    """One episode: ``reset`` names the segment, ``step`` answers the first turn with the segment's audio, the second
    turn is the answer."""

    modalities = ("audio",)

    def reset(self, row):
        info = row["extra_info"]
        self.target, self.seed, self.answer = int(info["segment"]), int(info["seed"]), row["answer"]
        self.turn, self.last = 0, ""
        return [{"role": "user", "content": f"listen {info['segment']}"}]

    def segment(self, segment: str) -> bytes:
        """WAV bytes of segment ``segment`` ("1"-"4") of the clip."""
        start = (int(segment) - 1) * SEGMENT
        return wav_bytes(clip(self.answer, self.target, self.seed)[start : start + SEGMENT])

    def step(self, assistant_message):
        self.turn += 1
        text = str(assistant_message["content"]).strip()
        if self.turn == 1:
            if text not in ("1", "2", "3", "4"):  # no segment named: the episode ends unanswered
                return [], None, True
            parts = [{"type": "audio", "audio": self.segment(text)}, {"type": "text", "text": "pitch?"}]
            return [{"role": "user", "content": parts}], None, False
        self.last = text
        return [], None, True

    def reward(self) -> float:
        return float(self.last == self.answer)
