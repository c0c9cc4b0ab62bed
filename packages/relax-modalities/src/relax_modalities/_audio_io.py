"""Audio reading: block-streamed decode (soundfile), mono mix-down, streaming soxr resampling.

Resampler: libsoxr at ``VHQ`` quality through python-soxr. It is a band-limited polyphase resampler
(windowed-sinc filters, ≈ 175 dB stop-band, pass-band to 95 % of Nyquist), so downsampling 44.1/48 kHz
to 16 kHz does not alias high frequencies into the speech band the way linear interpolation or
decimation would, and its ``ResampleStream`` keeps the filter state between blocks, so resampling a
file block by block gives the same samples as resampling it whole while memory stays bounded.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf
import soxr

from relax_modalities._errors import MediaError, check_readable


@dataclass(frozen=True)
class AudioSettings:
    """How audio becomes log-mel features (defaults are Whisper's / Qwen2.5-Omni's, with 128 mel bins).

    Attributes:
        sampling_rate: target rate in Hz; everything is resampled to it.
        n_fft: STFT window length in samples.
        hop_length: STFT hop in samples (one feature frame per hop).
        num_mel_bins: mel filters (the audio encoder's ``num_mel_bins``).
        max_frequency: upper edge of the mel filter bank in Hz.
        block_frames: frames read from the file per block; bounds read memory.
        max_duration_s: files whose header declares a longer duration are rejected (the audio
            analogue of a decompression bomb).
        chunk_frames: feature frames per chunk for streaming encoders (200 = 2 s, Qwen2.5-Omni's
            ``n_window * 2``).
        chunk_overlap_frames: feature frames shared by consecutive chunks.
    """

    sampling_rate: int = 16_000
    n_fft: int = 400
    hop_length: int = 160
    num_mel_bins: int = 128
    max_frequency: float = 8_000.0
    block_frames: int = 65_536
    max_duration_s: float = 4 * 3600.0
    chunk_frames: int = 200
    chunk_overlap_frames: int = 0

    def __post_init__(self) -> None:
        for name in ("sampling_rate", "n_fft", "hop_length", "num_mel_bins", "block_frames", "chunk_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"AudioSettings.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.chunk_overlap_frames < self.chunk_frames:
            raise ValueError(
                f"AudioSettings.chunk_overlap_frames must be in [0, chunk_frames={self.chunk_frames}), "
                f"got {self.chunk_overlap_frames}"
            )
        if self.max_frequency > self.sampling_rate / 2:
            raise ValueError(f"AudioSettings.max_frequency must be <= sampling_rate / 2, got {self.max_frequency}")


def _open(path: str | os.PathLike[str], settings: AudioSettings) -> sf.SoundFile:
    p = check_readable(path, "audio")
    try:
        f = sf.SoundFile(p)
    except sf.LibsndfileError as exc:
        raise MediaError(p, "audio", f"cannot decode: {exc.error_string}") from exc
    except Exception as exc:
        raise MediaError(p, "audio", f"cannot decode: {exc}") from exc
    if f.frames == 0 or f.samplerate <= 0:
        f.close()
        raise MediaError(p, "audio", "no audio frames")
    duration = f.frames / f.samplerate
    if duration > settings.max_duration_s:
        f.close()
        raise MediaError(p, "audio", f"too long: {duration:.0f} s exceeds max_duration_s {settings.max_duration_s}")
    # libsndfile silently shortens a WAV whose data chunk runs past the end; its log says so.
    if "should be" in f.extra_info:
        f.close()
        raise MediaError(p, "audio", "truncated: header declares more data than the file holds")
    return f


def _check_finite_block(path: str | os.PathLike[str], block: np.ndarray, start: int) -> None:
    # Float WAV/FLAC can store NaN and inf; they would flow into non-finite log-mel features and the
    # model, so the file is rejected rather than silently repaired (which value would be right?).
    finite = np.isfinite(block)
    if not finite.all():
        frame = start + int(np.argmin(finite.all(axis=1)))
        raise MediaError(path, "audio", f"non-finite sample (NaN or inf) at frame {frame}")


def iter_audio_blocks(path: str | os.PathLike[str], settings: AudioSettings | None = None) -> Iterator[np.ndarray]:
    """Stream a file as mono float32 blocks at ``settings.sampling_rate``.

    Memory is bounded by ``block_frames`` (plus the resampler's filter state), whatever the file
    length. Blocks may be empty while the resampler fills.

    Raises:
        MediaError: missing, empty, unreadable, truncated or too-long file, or a float file with a NaN
            or inf sample (possibly mid-stream, when the block holding it is read).
    """
    settings = settings or AudioSettings()
    f = _open(path, settings)
    with f:
        stream = None
        if f.samplerate != settings.sampling_rate:
            stream = soxr.ResampleStream(f.samplerate, settings.sampling_rate, 1, dtype="float32", quality="VHQ")
        read = 0
        try:
            while True:
                block = f.read(settings.block_frames, dtype="float32", always_2d=True)  # [n, channels]
                if len(block) == 0:
                    break
                _check_finite_block(path, block, read)
                read += len(block)
                mono = block.mean(axis=1, dtype=np.float32) if block.shape[1] > 1 else block[:, 0]
                yield stream.resample_chunk(mono, last=False) if stream is not None else np.ascontiguousarray(mono)
        except sf.LibsndfileError as exc:
            raise MediaError(path, "audio", f"corrupt data after {read} frames: {exc.error_string}") from exc
        if read < f.frames:
            raise MediaError(path, "audio", f"truncated: read {read} of {f.frames} declared frames")
        if stream is not None:
            yield stream.resample_chunk(np.zeros(0, dtype=np.float32), last=True)


def expected_num_samples(path: str | os.PathLike[str], settings: AudioSettings | None = None) -> int:
    """Samples `iter_audio_blocks` will yield for ``path``, from its header (no sample decoded).

    ``round_half_up(frames · target / rate)``, the length of soxr's stream output (checked against it
    for 9 rate pairs and 414 lengths); the file's frame count when no resampling is needed.

    Raises:
        MediaError: as `iter_audio_blocks` for a missing, unreadable or too-long file.
    """
    settings = settings or AudioSettings()
    with _open(path, settings) as f:
        frames, rate = int(f.frames), int(f.samplerate)
    target = settings.sampling_rate
    return frames if rate == target else (2 * frames * target + rate) // (2 * rate)


def load_audio(path: str | os.PathLike[str], settings: AudioSettings | None = None) -> np.ndarray:
    """Whole file as mono float32 ``[n]`` at ``settings.sampling_rate`` (read in bounded blocks)."""
    blocks = list(iter_audio_blocks(path, settings))
    return np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.float32)


def resample(waveform: np.ndarray, orig_rate: int, target_rate: int) -> np.ndarray:
    """Resample mono float32 audio with soxr VHQ (see the module docstring for why soxr)."""
    if orig_rate == target_rate:
        return np.asarray(waveform, dtype=np.float32)
    out: np.ndarray = soxr.resample(np.asarray(waveform, dtype=np.float32), orig_rate, target_rate, quality="VHQ")
    return out


def open_audio_track(
    path: str | os.PathLike[str], settings: AudioSettings | None = None
) -> Iterator[np.ndarray] | None:
    """The first audio stream of a container (e.g. an MP4) as mono float32 blocks at the target rate (PyAV).

    The container is opened now; blocks (one per decoded frame, resampled with a soxr stream) are
    decoded as they are taken, so memory does not grow with the track's length.

    Returns:
        An iterator of ``[n]`` float32 blocks, or ``None`` when the container has no audio stream.

    Raises:
        MediaError: unreadable container (here), corrupt audio stream or a NaN or inf sample (while
            iterating).
    """
    import av

    settings = settings or AudioSettings()
    p = check_readable(path, "audio")
    try:
        container = av.open(str(p))
    except Exception as exc:  # av raises InvalidDataError and friends
        raise MediaError(p, "audio", f"cannot decode audio track: {exc}") from exc
    if not container.streams.audio:
        container.close()
        return None
    return _track_blocks(p, container, settings)


def _track_blocks(p: Path, container: Any, settings: AudioSettings) -> Iterator[np.ndarray]:
    with container:
        try:
            astream = container.streams.audio[0]
            rate = astream.codec_context.sample_rate
            stream = soxr.ResampleStream(rate, settings.sampling_rate, 1, dtype="float32", quality="VHQ")
            for frame in container.decode(astream):
                x = frame.to_ndarray().astype(np.float32, copy=False)
                if not np.isfinite(x).all():
                    raise MediaError(p, "audio", "non-finite sample (NaN or inf) in the audio track")
                # Planar formats are [channels, n]; packed ones are [1, n * channels].
                x = x.mean(axis=0) if frame.format.is_planar else x.reshape(-1, len(frame.layout.channels)).mean(axis=1)
                yield stream.resample_chunk(x, last=False) if rate != settings.sampling_rate else x
            if rate != settings.sampling_rate:
                yield stream.resample_chunk(np.zeros(0, dtype=np.float32), last=True)
        except MediaError:
            raise
        except Exception as exc:  # av raises InvalidDataError and friends
            raise MediaError(p, "audio", f"cannot decode audio track: {exc}") from exc


def extract_audio_track(path: str | os.PathLike[str], settings: AudioSettings | None = None) -> np.ndarray | None:
    """Decode the first audio stream of a container (e.g. an MP4) with PyAV, mono at the target rate.

    Returns:
        ``[n]`` float32, or ``None`` when the container has no audio stream.

    Raises:
        MediaError: unreadable container, corrupt audio stream or a NaN or inf sample.
    """
    blocks = open_audio_track(path, settings)
    if blocks is None:
        return None
    parts = list(blocks)
    return np.concatenate(parts).astype(np.float32, copy=False) if parts else np.zeros(0, dtype=np.float32)
