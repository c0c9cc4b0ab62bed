"""Log-mel features (Whisper's recipe) of a whole clip, the shortest clip rule, and overlapping chunks."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from relax_modalities._audio_io import AudioSettings


def check_finite(samples: np.ndarray, start: int = 0) -> None:
    """Raise ValueError naming the first NaN or inf sample (index counted from ``start``)."""
    finite = np.isfinite(samples)
    if not finite.all():
        first = int(np.argmin(finite))
        raise ValueError(f"non-finite sample ({samples[first]}) at sample {start + first}: NaN or inf is not audio")


@dataclass
class AudioFeatures:
    """One audio clip as the audio encoder takes it.

    Attributes:
        input_features: ``[num_mel_bins, L]`` float32 log-mel features.
        num_frames: ``L``.
        num_tokens: LLM placeholder tokens after the encoder's two stride-2 stages.
    """

    input_features: torch.Tensor
    num_frames: int
    num_tokens: int


@dataclass
class FeatureChunk:
    """A chunk of consecutive feature frames.

    Attributes:
        features: ``[num_mel_bins, c]`` float32, ``c <= chunk_frames``.
        start_frame: index of its first frame in the whole stream.
        index: chunk number, from 0.
    """

    features: torch.Tensor
    start_frame: int
    index: int


def audio_token_count(num_frames: int) -> int:
    """Placeholder tokens for ``num_frames`` feature frames: ``((L - 1)//2 + 1 - 2)//2 + 1``."""
    if num_frames < 1:
        raise ValueError(f"num_frames must be >= 1, got {num_frames}")
    return ((num_frames - 1) // 2 + 1 - 2) // 2 + 1


MIN_AUDIO_FRAMES = 3
"""The fewest feature frames that give one audio token (`audio_token_count` of 1 and 2 frames is 0)."""


def min_audio_samples(settings: AudioSettings) -> int:
    """The shortest clip `log_mel` takes as it is: 3 hops (30 ms at 16 kHz), and more than ``n_fft // 2``.

    Shorter clips are zero-padded at the end to this length (as images below ``min_pixels`` are
    upscaled), so a 10 ms clip gives the three frames of one audio token instead of an error. The
    second bound is what the centred STFT's reflect padding needs.
    """
    return max(MIN_AUDIO_FRAMES * settings.hop_length, settings.n_fft // 2 + 1)


def num_feature_frames(num_samples: int, settings: AudioSettings) -> int:
    """Feature frames for ``num_samples`` samples (centred STFT, last frame dropped, as Whisper).

    Clips shorter than `min_audio_samples` count as padded to it.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    return max(num_samples, min_audio_samples(settings)) // settings.hop_length


def pad_short_clip(waveform: np.ndarray, settings: AudioSettings) -> np.ndarray:
    """``waveform`` zero-padded at the end to `min_audio_samples` when shorter; else itself."""
    short = min_audio_samples(settings) - len(waveform)
    return np.pad(waveform, (0, short)) if short > 0 else waveform


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    # Slaney's scale: linear below 1 kHz, logarithmic above (librosa's htk=False).
    f = np.asarray(f, dtype=np.float64)
    lin = 3.0 * f / 200.0
    log = 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) * 27.0 / np.log(6.4)
    return np.where(f >= 1000.0, log, lin)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    lin = 200.0 * m / 3.0
    log = 1000.0 * np.exp(np.log(6.4) * (m - 15.0) / 27.0)
    return np.where(m >= 15.0, log, lin)


@functools.lru_cache(maxsize=8)
def mel_filter_bank(num_freqs: int, num_mels: int, sampling_rate: int, max_frequency: float) -> np.ndarray:
    """Slaney-normalised triangular mel filters on the Slaney mel scale, ``[num_freqs, num_mels]``.

    Filters are spaced evenly in mel between 0 Hz and ``max_frequency``; each is scaled by
    ``2 / (upper_edge - lower_edge)`` so its area is constant (Slaney's "area normalisation").
    """
    fft_freqs = np.linspace(0.0, sampling_rate / 2.0, num_freqs)
    mel_edges = np.linspace(_hz_to_mel(np.array(0.0)), _hz_to_mel(np.array(max_frequency)), num_mels + 2)
    hz_edges = _mel_to_hz(mel_edges)  # [num_mels + 2]
    widths = np.diff(hz_edges)  # [num_mels + 1]
    slopes = hz_edges[None, :] - fft_freqs[:, None]  # [F, num_mels + 2]
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    filters = np.maximum(0.0, np.minimum(down, up))  # [F, num_mels]
    filters *= 2.0 / (hz_edges[2:] - hz_edges[:-2])
    filters.setflags(write=False)
    out: np.ndarray = filters
    return out


def _filters(settings: AudioSettings) -> torch.Tensor:
    fb = mel_filter_bank(settings.n_fft // 2 + 1, settings.num_mel_bins, settings.sampling_rate, settings.max_frequency)
    return torch.from_numpy(fb.astype(np.float32)).T.contiguous()  # [num_mels, F]


def _log_mel_frames(padded: torch.Tensor, settings: AudioSettings) -> torch.Tensor:
    """log10 mel power of every full window of an already padded signal, ``[num_mels, frames]``."""
    window = torch.hann_window(settings.n_fft)
    stft = torch.stft(padded, settings.n_fft, settings.hop_length, window=window, center=False, return_complex=True)
    power = stft.abs() ** 2  # [F, frames]
    mel = _filters(settings) @ power  # [num_mels, frames]
    return torch.clamp(mel, min=1e-10).log10()


def _finish(log_spec: torch.Tensor, ceiling: float) -> torch.Tensor:
    # Whisper: floor at 8 decades (80 dB) below the loudest value, then map to roughly [-1, 1].
    return (torch.maximum(log_spec, torch.tensor(ceiling - 8.0)) + 4.0) / 4.0


def _finish_(log_spec: torch.Tensor, ceiling: float) -> torch.Tensor:
    """`_finish` in place (the same float32 operations, so the same values), without a second copy."""
    torch.maximum(log_spec, torch.tensor(ceiling - 8.0), out=log_spec)
    return log_spec.add_(4.0).div_(4.0)


def log_mel(waveform: np.ndarray | torch.Tensor, settings: AudioSettings | None = None) -> torch.Tensor:
    """Whisper log-mel features of a whole mono clip at ``settings.sampling_rate``.

    Centred STFT (reflect padding of ``n_fft // 2``), power spectrum, mel filters, log10,
    floor at ``max - 8``, then ``(x + 4) / 4``. Matches transformers' ``WhisperFeatureExtractor``
    (``padding="longest"``) within 1e-4 absolute. A clip shorter than `min_audio_samples` (30 ms at
    16 kHz) is zero-padded at the end to it first. `log_mel_stream` computes the same features block
    by block.

    Args:
        waveform: ``[n]`` finite float mono samples, ``n >= 1``.
        settings: STFT and mel parameters.

    Returns:
        ``[num_mel_bins, num_feature_frames(n)]`` float32 (``n // hop_length`` from 30 ms on).

    Raises:
        ValueError: for an empty or not 1-D waveform, or one with NaN or inf samples.
    """
    settings = settings or AudioSettings()
    wave = np.asarray(waveform, dtype=np.float32)
    if wave.ndim != 1 or wave.size == 0:
        raise ValueError(f"waveform must be 1-D with at least one sample, got shape {wave.shape}")
    check_finite(wave)
    x = torch.from_numpy(np.ascontiguousarray(pad_short_clip(wave, settings)))
    half = settings.n_fft // 2
    padded = torch.nn.functional.pad(x[None, None], (half, half), mode="reflect")[0, 0]
    spec = _log_mel_frames(padded, settings)[:, :-1]  # Whisper drops the last frame
    return _finish(spec, float(spec.max()))


def chunk_features(features: torch.Tensor, settings: AudioSettings | None = None) -> list[FeatureChunk]:
    """Split ``[num_mels, L]`` features into chunks of ``chunk_frames`` overlapping by ``chunk_overlap_frames``.

    Chunk ``j`` starts at ``j * (chunk_frames - overlap)``; the last chunk may be shorter, and a tail
    already covered entirely by the previous chunk's overlap is not repeated.
    """
    settings = settings or AudioSettings()
    size, stride = settings.chunk_frames, settings.chunk_frames - settings.chunk_overlap_frames
    n = features.shape[1]
    chunks: list[FeatureChunk] = []
    start = 0
    while start < n:
        chunks.append(FeatureChunk(features[:, start : start + size], start, len(chunks)))
        if start + size >= n:
            break
        start += stride
    return chunks
