"""Log-mel features block by block: whole-clip features in bounded memory, and a live chunk buffer.

Both cut the pushed samples into exactly the STFT windows `log_mel` uses on the whole clip (the
same reflect padding at both ends, the same zero padding of a clip under `min_audio_samples`),
carrying the ``n_fft - hop_length`` samples that consecutive windows share from one block to the
next, so every frame equals the offline one. They differ in the Whisper ``max - 8`` floor:
`log_mel_stream` keeps the unfloored frames and floors them at the whole clip's maximum at the
end (equal to `log_mel`), `StreamingLogMel` emits chunks as soon as they are complete and floors
them at the loudest value seen so far.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from relax_modalities._audio_io import AudioSettings
from relax_modalities._mel import (
    FeatureChunk,
    _finish,
    _finish_,
    _log_mel_frames,
    check_finite,
    min_audio_samples,
    num_feature_frames,
)


class _Framer:
    """log10 mel frames of a pushed mono stream, each computed as soon as its window is complete.

    Holds at most one window of samples plus the last push. Frame ``i`` covers padded samples
    ``[i * hop, i * hop + n_fft)`` of the clip reflect-padded by ``n_fft // 2`` on both sides, and the
    stream ends after frame ``received // hop - 1`` (Whisper drops the last frame).
    """

    def __init__(self, settings: AudioSettings) -> None:
        self.settings = settings
        self._half = settings.n_fft // 2
        self.received = 0  # samples pushed so far
        self.next_frame = 0  # first frame not yet computed
        self._head: list[np.ndarray] = []  # samples held until the left reflection can be built
        self._buf = np.zeros(0, dtype=np.float32)  # padded-signal samples from padded index self._offset
        self._offset = 0

    @property
    def pending_samples(self) -> int:
        return len(self._buf) + sum(len(h) for h in self._head)

    def push(self, pcm: np.ndarray) -> torch.Tensor | None:
        """Add samples; return the frames ``[num_mels, k]`` they complete (None when none).

        Raises:
            ValueError: for a NaN or inf sample (its index in the stream is named).
        """
        pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
        check_finite(pcm, self.received)
        self.received += len(pcm)
        if self._offset == 0 and len(self._buf) == 0:
            self._head.append(pcm)
            if self.received <= self._half:
                return None
            x = np.concatenate(self._head)
            self._head = []
            pcm = np.concatenate([x[self._half : 0 : -1], x])  # left reflection, then the samples
        self._buf = np.concatenate([self._buf, pcm])
        return self._compute(self._complete_frames())

    def finish(self) -> torch.Tensor | None:
        """End of stream (at least one sample pushed): pad, reflect on the right, return the last frames."""
        s = self.settings
        frames = []
        short = min_audio_samples(s) - self.received
        if short > 0:  # as log_mel: a clip under the minimum is zero-padded at the end
            frames.append(self.push(np.zeros(short, dtype=np.float32)))
        # Right reflection of the last `half` samples, taken from the signal part of the buffer
        # (which holds at least n_fft - hop >= half + 1 of them once a frame is computed).
        sig_end = len(self._buf)
        tail = self._buf[sig_end - self._half - 1 : sig_end - 1][::-1]
        self._buf = np.concatenate([self._buf, tail])
        frames.append(self._compute(self.received // s.hop_length))
        done = [f for f in frames if f is not None]
        return torch.cat(done, dim=1) if len(done) > 1 else (done[0] if done else None)

    def _complete_frames(self) -> int:
        s = self.settings
        have = self._offset + len(self._buf)  # padded samples available
        complete = (have - s.n_fft) // s.hop_length + 1 if have >= s.n_fft else 0
        # Never compute past the offline frame count (n // hop), even before finish().
        return min(complete, self.received // s.hop_length)

    def _compute(self, upto: int) -> torch.Tensor | None:
        s = self.settings
        if upto <= self.next_frame:
            return None
        lo = self.next_frame * s.hop_length - self._offset
        hi = (upto - 1) * s.hop_length + s.n_fft - self._offset
        spec = _log_mel_frames(torch.from_numpy(np.ascontiguousarray(self._buf[lo:hi])), s)  # [M, upto - next]
        self.next_frame = upto
        drop = upto * s.hop_length - self._offset
        self._buf = self._buf[drop:]
        self._offset += drop
        return spec


class _FrameSink:
    """Frames ``[num_mels, k]`` gathered into one tensor, preallocated when the length is known.

    With the expected frame count the frames are written in place into one ``[num_mels, L]`` tensor,
    so the features are held once; without it (or past it) they are kept in a list and joined at the
    end, which holds them twice for the moment of the join.
    """

    def __init__(self, num_mels: int, capacity: int) -> None:
        self._out = torch.empty(num_mels, capacity, dtype=torch.float32) if capacity > 0 else None
        self._filled = 0
        self._extra: list[torch.Tensor] = []
        self.ceiling = -np.inf

    def add(self, spec: torch.Tensor | None) -> None:
        if spec is None:
            return
        self.ceiling = max(self.ceiling, float(spec.max()))
        k = spec.shape[1]
        if self._out is not None and not self._extra and self._filled + k <= self._out.shape[1]:
            self._out[:, self._filled : self._filled + k] = spec
            self._filled += k
        else:
            self._extra.append(spec)

    def result(self) -> torch.Tensor:
        if self._out is not None and not self._extra and self._filled == self._out.shape[1]:
            return self._out
        head = [self._out[:, : self._filled]] if self._out is not None and self._filled else []
        parts = head + self._extra
        self._out, self._extra = None, []
        return torch.cat(parts, dim=1)


def log_mel_stream(
    blocks: Iterable[np.ndarray], settings: AudioSettings | None = None, *, num_samples: int | None = None
) -> torch.Tensor:
    """`log_mel` of the concatenated ``blocks``, computed block by block.

    Each block's complete STFT windows are turned into log10 mel frames as it arrives; the samples
    the next window shares with it are carried over, so the frames are those of the whole clip, and
    the ``max - 8`` floor is applied at the end with the whole clip's maximum, in place. Working
    memory is one block plus one window of samples and that block's STFT; what grows with the clip is
    only the result, ``num_mel_bins × 100`` float32 per second of 16 kHz audio (50 KiB/s).

    Args:
        blocks: mono float blocks at ``settings.sampling_rate`` (any sizes, empty ones allowed), e.g.
            `iter_audio_blocks`.
        settings: STFT and mel parameters.
        num_samples: the total the blocks will hold, if known (`expected_num_samples` reads it from a
            file's header): the features are then written into one preallocated tensor and held once;
            otherwise (or if the blocks hold a different total) they are joined at the end, held twice
            for that moment. The result is the same either way.

    Returns:
        ``[num_mel_bins, num_feature_frames(n)]`` float32, equal to ``log_mel(np.concatenate(blocks))``
        to float32 rounding.

    Raises:
        ValueError: no samples at all, or a NaN or inf sample.
    """
    settings = settings or AudioSettings()
    framer = _Framer(settings)
    capacity = num_feature_frames(num_samples, settings) if num_samples else 0
    sink = _FrameSink(settings.num_mel_bins, capacity)
    for block in blocks:
        sink.add(framer.push(block))
    if framer.received == 0:
        raise ValueError("no audio samples")
    sink.add(framer.finish())
    return _finish_(sink.result(), sink.ceiling)


class StreamingLogMel:
    """Accepts live PCM in arbitrary pushes and emits feature chunks as soon as they are complete.

    Frames are the same as `log_mel` computes offline (same windows, same reflect padding at both
    ends, a clip under `min_audio_samples` zero-padded to it); the ``max - 8`` floor uses the
    loudest value seen so far instead of the whole clip's, so a chunk equals the offline one whenever
    the loudest frame came no later than the chunk (for steady levels, always). Memory holds at most
    one chunk of frames plus one window of samples. For a stored file whose features must equal the
    offline ones exactly, use `log_mel_stream`.

    Args:
        settings: STFT, mel and chunk parameters.
    """

    def __init__(self, settings: AudioSettings | None = None) -> None:
        self.settings = settings or AudioSettings()
        self._framer = _Framer(self.settings)
        self._frames: list[torch.Tensor] = []  # computed log10 frames not yet fully emitted, [num_mels, k] each
        self._frames_start = 0  # frame index of self._frames[0][:, 0]
        self._next_chunk_start = 0
        self._chunks_emitted = 0
        self._ceiling = -np.inf
        self._finished = False

    @property
    def pending_samples(self) -> int:
        """Samples held (at most one window plus the last push): the buffer's sample memory."""
        return self._framer.pending_samples

    @property
    def pending_frames(self) -> int:
        """Feature frames held for chunks not yet emitted (at most ``chunk_frames`` plus the last push)."""
        return sum(f.shape[1] for f in self._frames)

    def push(self, pcm: np.ndarray) -> list[FeatureChunk]:
        """Add mono float samples (any length, may be empty); return the chunks completed by them.

        Raises:
            ValueError: for a NaN or inf sample.
        """
        if self._finished:
            raise RuntimeError("StreamingLogMel.push after finish()")
        self._add(self._framer.push(pcm))
        return self._emit(final=False)

    def finish(self) -> list[FeatureChunk]:
        """End of stream: pad by reflection on the right, compute the last frames, emit the rest."""
        if self._finished:
            return []
        self._finished = True
        if self._framer.received == 0:
            return []
        self._add(self._framer.finish())
        return self._emit(final=True)

    def _add(self, spec: torch.Tensor | None) -> None:
        if spec is not None:
            self._frames.append(spec)
            self._ceiling = max(self._ceiling, float(spec.max()))

    def _emit(self, final: bool) -> list[FeatureChunk]:
        s = self.settings
        size, stride = s.chunk_frames, s.chunk_frames - s.chunk_overlap_frames
        computed = self._framer.next_frame
        out: list[FeatureChunk] = []
        if not self._frames:
            return out
        frames = torch.cat(self._frames, dim=1) if len(self._frames) > 1 else self._frames[0]
        self._frames = [frames]
        while True:
            start = self._next_chunk_start
            end = start + size
            done = computed >= end
            tail = final and start < computed and (start == 0 or start + s.chunk_overlap_frames < computed)
            if not (done or tail):
                break
            local = frames[:, start - self._frames_start : min(end, computed) - self._frames_start]
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
