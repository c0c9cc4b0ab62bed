"""Log-mel features (Whisper's recipe), overlapping chunks, and a live streaming feature buffer."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from relax_modalities._audio_io import AudioSettings


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


def num_feature_frames(num_samples: int, settings: AudioSettings) -> int:
    """Feature frames for ``num_samples`` samples (centred STFT, last frame dropped, as Whisper)."""
    return num_samples // settings.hop_length


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


def log_mel(waveform: np.ndarray | torch.Tensor, settings: AudioSettings | None = None) -> torch.Tensor:
    """Whisper log-mel features of a whole mono clip at ``settings.sampling_rate``.

    Centred STFT (reflect padding of ``n_fft // 2``), power spectrum, mel filters, log10,
    floor at ``max - 8``, then ``(x + 4) / 4``. Matches transformers' ``WhisperFeatureExtractor``
    (``padding="longest"``) within 1e-4 absolute.

    Args:
        waveform: ``[n]`` float mono samples, ``n > n_fft // 2``.
        settings: STFT and mel parameters.

    Returns:
        ``[num_mel_bins, n // hop_length]`` float32.
    """
    settings = settings or AudioSettings()
    x = torch.as_tensor(np.asarray(waveform, dtype=np.float32))
    half = settings.n_fft // 2
    if x.ndim != 1 or x.numel() <= half:
        raise ValueError(f"waveform must be 1-D with more than {half} samples, got shape {tuple(x.shape)}")
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


class StreamingLogMel:
    """Accepts live PCM in arbitrary pushes and emits feature chunks as soon as they are complete.

    Frames are the same as `log_mel` computes offline (same windows, same reflect padding at both
    ends); the ``max - 8`` floor uses the loudest value seen so far instead of the whole clip's, so
    a chunk equals the offline one whenever the loudest frame came no later than the chunk (for
    steady levels, always). Memory holds at most one chunk of frames plus one window of samples.

    Args:
        settings: STFT, mel and chunk parameters.
    """

    def __init__(self, settings: AudioSettings | None = None) -> None:
        self.settings = settings or AudioSettings()
        self._half = self.settings.n_fft // 2
        self._received = 0  # samples pushed so far
        self._head: list[np.ndarray] = []  # samples held until the left reflection can be built
        self._buf = np.zeros(0, dtype=np.float32)  # padded-signal samples from padded index self._offset
        self._offset = 0
        self._next_frame = 0  # first frame not yet computed
        self._frames: list[torch.Tensor] = []  # computed log10 frames not yet fully emitted, [num_mels, k] each
        self._frames_start = 0  # frame index of self._frames[0][:, 0]
        self._next_chunk_start = 0
        self._chunks_emitted = 0
        self._ceiling = -np.inf
        self._finished = False

    @property
    def pending_samples(self) -> int:
        """Samples held (at most one window plus the last push): the buffer's sample memory."""
        return len(self._buf) + sum(len(h) for h in self._head)

    @property
    def pending_frames(self) -> int:
        """Feature frames held for chunks not yet emitted (at most ``chunk_frames`` plus the last push)."""
        return sum(f.shape[1] for f in self._frames)

    def push(self, pcm: np.ndarray) -> list[FeatureChunk]:
        """Add mono float samples (any length, may be empty); return the chunks completed by them."""
        if self._finished:
            raise RuntimeError("StreamingLogMel.push after finish()")
        pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
        self._received += len(pcm)
        if self._offset == 0 and len(self._buf) == 0:
            self._head.append(pcm)
            if self._received <= self._half:
                return []
            x = np.concatenate(self._head)
            self._head = []
            pcm = np.concatenate([x[self._half : 0 : -1], x])  # left reflection, then the samples
        self._buf = np.concatenate([self._buf, pcm])
        self._compute(self._complete_frames())
        return self._emit(final=False)

    def finish(self) -> list[FeatureChunk]:
        """End of stream: pad by reflection on the right, compute the last frames, emit the rest."""
        if self._finished:
            return []
        self._finished = True
        total = self._received // self.settings.hop_length
        if self._head:  # never got past the left reflection: fall back to the offline path
            x = np.concatenate(self._head)
            if len(x) <= self._half:
                return []
            self._buf = np.concatenate([x[self._half : 0 : -1], x])
        # Right reflection of the last `half` samples, taken from the signal part of the buffer.
        sig_end = len(self._buf)
        tail = self._buf[sig_end - self._half - 1 : sig_end - 1][::-1]
        self._buf = np.concatenate([self._buf, tail])
        self._compute(total)
        return self._emit(final=True)

    def _complete_frames(self) -> int:
        s = self.settings
        have = self._offset + len(self._buf)  # padded samples available
        complete = (have - s.n_fft) // s.hop_length + 1 if have >= s.n_fft else 0
        # Never emit past the offline frame count (n // hop), even before finish().
        return min(complete, self._received // s.hop_length)

    def _compute(self, upto: int) -> None:
        s = self.settings
        if upto <= self._next_frame:
            return
        lo = self._next_frame * s.hop_length - self._offset
        hi = (upto - 1) * s.hop_length + s.n_fft - self._offset
        spec = _log_mel_frames(torch.from_numpy(np.ascontiguousarray(self._buf[lo:hi])), s)  # [M, upto - next]
        self._frames.append(spec)
        self._ceiling = max(self._ceiling, float(spec.max()))
        self._next_frame = upto
        drop = upto * s.hop_length - self._offset
        self._buf = self._buf[drop:]
        self._offset += drop

    def _emit(self, final: bool) -> list[FeatureChunk]:
        s = self.settings
        size, stride = s.chunk_frames, s.chunk_frames - s.chunk_overlap_frames
        out: list[FeatureChunk] = []
        if not self._frames:
            return out
        frames = torch.cat(self._frames, dim=1) if len(self._frames) > 1 else self._frames[0]
        self._frames = [frames]
        while True:
            start = self._next_chunk_start
            end = start + size
            done = self._next_frame >= end
            tail = (
                final and start < self._next_frame and (start == 0 or start + s.chunk_overlap_frames < self._next_frame)
            )
            if not (done or tail):
                break
            local = frames[:, start - self._frames_start : min(end, self._next_frame) - self._frames_start]
            out.append(FeatureChunk(_finish(local, self._ceiling), start, self._chunks_emitted))
            self._chunks_emitted += 1
            self._next_chunk_start += stride
            if not done:
                break
        keep_from = self._next_chunk_start - self._frames_start
        if keep_from > 0:
            self._frames = [frames[:, keep_from:]]
            self._frames_start = self._next_chunk_start
        return out
