"""The listen example (``examples/listen``): its rows, its environment (the segment the first turn names carries the
answer's tone, every other segment none) and its run config, which loads with the environment's audio declared."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from relax_core import import_file
from relax_services.agents import EpisodeMedia, load_environment
from relax_services.config import load_run_config
from relax_services.models import DEFAULT_SOURCE, open_checkpoint

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "listen"
HZ = {"1": 250.0, "2": 500.0, "3": 1000.0, "4": 2000.0}  # each tone within ±5 % of its code's pitch
RATE, SAMPLES = 16_000, 8_000  # 0.5 s segments
# A segment's spectrum has bins RATE / SAMPLES = 2 Hz apart. Noise of std 0.02 has |FFT| ≈ Rayleigh of scale
# 0.02·√(SAMPLES/2) ≈ 1.3, whose largest of 4,001 bins is ≈ 3.5 × its median (√(ln 4001 / ln 2)); a tone of
# amplitude ≥ 0.3 peaks at ≥ 0.3·SAMPLES/2 = 1,200, ≥ 700 × that median. So: a tone is a peak ≥ 100 × the median
# and RMS ≥ 0.3/√2 - 0.02; no tone is a peak < 10 × the median and RMS < 0.02·1.1 (8,000 samples: ±1.6 % at 2σ).


def _spectrum(wav: bytes) -> tuple[float, float, float]:
    """The dominant frequency (Hz), its peak over the median magnitude, and the RMS of WAV bytes."""
    x, rate = sf.read(io.BytesIO(wav), dtype="float64")
    assert (rate, x.shape) == (RATE, (SAMPLES,))
    mag = np.abs(np.fft.rfft(x))
    k = int(mag[1:].argmax()) + 1
    return k * RATE / SAMPLES, float(mag[k] / np.median(mag)), float(np.sqrt(np.mean(x**2)))


@pytest.fixture(scope="module")
def rows() -> list[dict[str, object]]:
    prepare = import_file(EXAMPLE / "prepare.py", "relax_test_listen", "examples/listen/prepare.py")
    rows: list[dict[str, object]] = json.loads(json.dumps(prepare.rows(12, seed=0)))  # as the JSONL file holds them
    return rows


def test_only_the_named_segment_carries_the_answers_tone(rows) -> None:  # type: ignore[no-untyped-def]
    env_spec = load_environment(f"{EXAMPLE / 'listen_env.py'}:Listen")
    assert env_spec.modalities == ("audio",) and env_spec.has_step and env_spec.has_reward
    assert {str(r["answer"]) for r in rows} == set(HZ) and {r["extra_info"]["segment"] for r in rows} == {1, 2, 3, 4}  # type: ignore[index]
    for row in rows:
        info = row["extra_info"]
        assert isinstance(info, dict) and 1 <= info["segment"] <= 4
        assert row["prompt"] == f"listen {info['segment']}"
        env = env_spec.new()
        [first] = env.reset({"answer": row["answer"], "extra_info": info})  # type: ignore[attr-defined]
        assert first["content"] == row["prompt"]  # text only: nothing to hear before the listen
        for other in {"1", "2", "3", "4"} - {str(info["segment"])}:  # noise only: no tone, no answer
            _, peak, rms = _spectrum(env.segment(other))  # type: ignore[attr-defined]
            assert peak < 10 and rms < 0.022, (row, other, peak, rms)
        messages, reward, done = env.step({"role": "assistant", "content": f" {info['segment']}"})  # type: ignore[attr-defined]
        assert (reward, done) == (None, False)
        [audio] = [p for p in messages[0]["content"] if p["type"] == "audio"]
        hz, peak, rms = _spectrum(audio["audio"])
        assert peak > 100 and rms > 0.3 / np.sqrt(2) - 0.02, (row, peak, rms)
        # Within ±5 % (plus one 2 Hz bin) of the answer's pitch: the four pitches are an octave apart.
        assert abs(hz - HZ[str(row["answer"])]) <= 0.05 * HZ[str(row["answer"])] + RATE / SAMPLES, (row, hz)
        assert env.step({"role": "assistant", "content": str(row["answer"])}) == ([], None, True)  # type: ignore[attr-defined]
        assert env.reward() == 1.0  # type: ignore[attr-defined]
        wrong = env_spec.new()
        wrong.reset({"answer": row["answer"], "extra_info": info})  # type: ignore[attr-defined]
        wrong.step({"role": "assistant", "content": str(info["segment"])})  # type: ignore[attr-defined]
        wrong.step({"role": "assistant", "content": str(int(str(row["answer"])) % 4 + 1)})  # type: ignore[attr-defined]
        assert wrong.reward() == 0.0  # type: ignore[attr-defined]
        for reply in ("", "x", "5"):  # names no segment: the episode ends unanswered
            silent = env_spec.new()
            silent.reset({"answer": row["answer"], "extra_info": info})  # type: ignore[attr-defined]
            assert silent.step({"role": "assistant", "content": reply}) == ([], None, True)  # type: ignore[attr-defined]
            assert silent.reward() == 0.0  # type: ignore[attr-defined]


def test_a_segment_is_twelve_audio_tokens_of_the_default_model(rows) -> None:  # type: ignore[no-untyped-def]
    # 8,000 samples / hop 160 = 50 feature frames; ((50 - 1)//2 + 1 - 2)//2 + 1 = 12 encoder outputs.
    env = load_environment(f"{EXAMPLE / 'listen_env.py'}:Listen").new()
    row = rows[0]
    env.reset({"answer": row["answer"], "extra_info": row["extra_info"]})  # type: ignore[attr-defined]
    messages, _, _ = env.step({"role": "assistant", "content": "2"})  # type: ignore[attr-defined]
    media = EpisodeMedia.of_checkpoint(open_checkpoint(DEFAULT_SOURCE))
    try:
        turn = media.read(messages, "listen")
    finally:
        media.close()
    assert [(s.modality, s.num_tokens) for s in turn.slots] == [("audio", 12)]


def test_the_run_config_loads() -> None:
    cfg = load_run_config(EXAMPLE / "listen.yaml", [])
    assert cfg.rollout.env is not None and cfg.rollout.env.endswith("listen_env.py:Listen")
    assert (cfg.rollout.max_turns, cfg.rollout.max_new_tokens) == (2, 2)
