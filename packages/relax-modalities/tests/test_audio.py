"""Audio path: streaming reads, soxr resampling, Whisper log-mel parity, chunks and the live buffer."""

import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from relax_modalities import (
    AudioSettings,
    MediaError,
    ProcessorSettings,
    SampleProcessor,
    StreamingLogMel,
    audio_token_count,
    chunk_features,
    expected_num_samples,
    iter_audio_blocks,
    load_audio,
    log_mel,
    log_mel_stream,
    mel_filter_bank,
    min_audio_samples,
    num_feature_frames,
    process_sample,
    resample,
)
from relax_modalities.text import TINY_VOCAB, TinyTokenizer

WHISPER_TOL = 1e-4  # stated tolerance against WhisperFeatureExtractor (float32 STFT)


def _tone(freq: float, seconds: float, rate: int, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def _peak_hz(x: np.ndarray, rate: int) -> float:
    spec = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.argmax(spec) * rate / len(x))


def test_mel_filters_match_transformers() -> None:
    from transformers.audio_utils import mel_filter_bank as ref

    expected = ref(201, 128, 0.0, 8000.0, 16000, norm="slaney", mel_scale="slaney")
    np.testing.assert_allclose(mel_filter_bank(201, 128, 16000, 8000.0), expected, atol=1e-12)


@pytest.mark.parametrize("n", [16000, 12345, 48000, 801])
def test_log_mel_matches_whisper_feature_extractor(n: int) -> None:
    from transformers import WhisperFeatureExtractor

    rng = np.random.default_rng(n)
    x = (0.1 * rng.standard_normal(n) + np.sin(np.arange(n) * 0.05)).astype(np.float32)
    ref = WhisperFeatureExtractor(feature_size=128)(
        x, sampling_rate=16000, padding="longest", return_attention_mask=True, return_tensors="pt"
    )
    ours = log_mel(x)
    assert ours.shape == (128, n // 160) == ref["input_features"].shape[1:]
    assert int(ref["attention_mask"].sum()) == n // 160
    torch.testing.assert_close(ours, ref["input_features"][0], atol=WHISPER_TOL, rtol=0)


def test_audio_token_count_formula() -> None:
    # ((L - 1)//2 + 1 - 2)//2 + 1 by hand: 100 frames (1 s) -> 25 tokens, 3000 frames (30 s) -> 750.
    assert audio_token_count(100) == 25
    assert audio_token_count(3000) == 750
    assert audio_token_count(7) == 2


def test_stereo_file_is_mixed_to_mono_and_resampled(tmp_path: Path) -> None:
    rate = 44100
    left, right = _tone(1000, 1.0, rate, 0.4), _tone(1000, 1.0, rate, 0.2)
    path = tmp_path / "s.wav"
    sf.write(path, np.stack([left, right], axis=1), rate, subtype="FLOAT")
    x = load_audio(path)
    assert abs(len(x) - 16000) <= 1
    assert abs(_peak_hz(x, 16000) - 1000) < 2
    assert np.isclose(np.abs(x[2000:14000]).max(), 0.3, atol=0.01)  # mean of the two channels


def test_resampling_rejects_aliases() -> None:
    # A 12 kHz tone at 48 kHz is above the 16 kHz output's Nyquist (8 kHz): soxr must remove it,
    # where naive decimation (every 3rd sample) folds it to 4 kHz at full strength.
    x = _tone(12000, 1.0, 48000)
    y = resample(x, 48000, 16000)
    assert abs(_peak_hz(x[::3], 16000) - 4000) < 2 and np.abs(x[::3]).max() > 0.4
    assert np.abs(y[1000:-1000]).max() < 1e-3


def test_blocked_reads_equal_whole_file_resampling(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    x = (0.3 * rng.standard_normal(22050 * 3)).astype(np.float32)
    path = tmp_path / "n.flac"
    sf.write(path, x, 22050, subtype="PCM_24")
    settings = AudioSettings(block_frames=1000)
    blocks = list(iter_audio_blocks(path, settings))
    assert max(len(b) for b in blocks) <= 2 * 1000  # one block plus the filter delay flushed at the end
    streamed = np.concatenate(blocks)
    whole = resample(sf.read(path, dtype="float32")[0], 22050, 16000)
    assert len(streamed) == len(whole)
    np.testing.assert_allclose(streamed, whole, atol=1e-5)


def _peak_bytes(path: Path, settings: AudioSettings) -> tuple[int, int]:
    tracemalloc.start()  # numpy buffers are traced; torch's are not, so the buffer sizes are checked too
    stream = StreamingLogMel(settings)
    n = 0
    for block in iter_audio_blocks(path, settings):
        n += sum(c.features.shape[1] for c in stream.push(block))
        assert stream.pending_samples <= settings.n_fft + settings.block_frames
        assert stream.pending_frames <= settings.chunk_frames + settings.block_frames // settings.hop_length + 1
    n += sum(c.features.shape[1] for c in stream.finish())
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak, n


def test_streaming_memory_is_bounded_independently_of_length(tmp_path: Path) -> None:
    settings = AudioSettings(block_frames=8192)
    peaks = {}
    for seconds in (10, 60):
        path = tmp_path / f"{seconds}.wav"
        sf.write(path, _tone(440, seconds, 16000), 16000, subtype="PCM_16")
        peaks[seconds], frames = _peak_bytes(path, settings)
        assert frames == seconds * 100
    # 6x the audio, not 6x the memory (a whole 60 s clip in float32 alone would be 3.8 MB).
    assert peaks[60] < 1.3 * peaks[10]
    assert peaks[60] < 2_000_000


# 3.3 s = 330 frames; the last chunk starts where the previous one stops short of frame 330.
@pytest.mark.parametrize(("chunk", "overlap", "last_start"), [(200, 0, 200), (50, 10, 280), (64, 63, 266)])
def test_streaming_buffer_equals_offline_chunks(chunk: int, overlap: int, last_start: int) -> None:
    settings = AudioSettings(chunk_frames=chunk, chunk_overlap_frames=overlap)
    rng = np.random.default_rng(chunk)
    x = _tone(440, 3.3, 16000)  # steady level: the running floor equals the whole-clip floor
    offline = chunk_features(log_mel(x, settings), settings)
    stream = StreamingLogMel(settings)
    live = []
    i = 0
    while i < len(x):
        k = int(rng.integers(1, 4000))
        live += stream.push(x[i : i + k])
        i += k
    live += stream.finish()
    assert [c.start_frame for c in live] == [c.start_frame for c in offline]
    assert [c.start_frame for c in offline] == list(range(0, last_start + 1, chunk - overlap))
    assert offline[-1].start_frame + offline[-1].features.shape[1] == 330
    for a, b in zip(live, offline, strict=True):
        torch.testing.assert_close(a.features, b.features, atol=1e-5, rtol=0)


def test_streaming_buffer_emits_as_soon_as_a_chunk_is_complete() -> None:
    settings = AudioSettings(chunk_frames=100, chunk_overlap_frames=0)
    stream = StreamingLogMel(settings)
    x = _tone(300, 2.0, 16000)
    # Frame 99 (the last of chunk 0) spans samples up to 99*160 + 200 = 16040.
    assert stream.push(x[:16039]) == []
    chunks = stream.push(x[16039:16040])
    assert [c.index for c in chunks] == [0] and chunks[0].features.shape == (128, 100)


def _wav_bytes(seconds: float) -> bytes:
    import io

    buf = io.BytesIO()
    sf.write(buf, _tone(440, seconds, 16000), 16000, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def _flac_bytes(seconds: float) -> bytes:
    import io

    buf = io.BytesIO()
    sf.write(buf, _tone(440, seconds, 16000), 16000, format="FLAC", subtype="PCM_16")
    return buf.getvalue()


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        ("empty.wav", b"", "empty file"),
        ("trunc.wav", _wav_bytes(1.0)[:20000], "truncated"),
        ("trunc.flac", _flac_bytes(2.0)[:3000], "truncated|corrupt"),
        ("garbage.wav", b"RIFF" + bytes(200), "cannot decode"),
        ("picture.wav", b"\x89PNG\r\n\x1a\n" + bytes(100), "cannot decode"),
        ("long.wav", _wav_bytes(3.0), "too long"),
    ],
)
def test_bad_audio_raises_media_error(tmp_path: Path, name: str, content: bytes, reason: str) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(MediaError, match=reason) as info:
        load_audio(path, AudioSettings(max_duration_s=2.5))
    assert info.value.modality == "audio" and str(path) in str(info.value)


def _whisper(x: np.ndarray) -> torch.Tensor:
    from transformers import WhisperFeatureExtractor

    ref = WhisperFeatureExtractor(feature_size=128)(x, sampling_rate=16000, padding="longest", return_tensors="pt")
    out: torch.Tensor = ref["input_features"][0]
    return out


@pytest.mark.parametrize("n", [1, 160, 200, 201, 479])
def test_a_clip_under_30_ms_is_zero_padded_to_three_frames(n: int) -> None:
    # 10 ms (160 samples) used to be rejected. The shortest clip with one audio token is 3 frames
    # (audio_token_count(2) == 0), i.e. 3 hops = 480 samples; shorter clips are zero-padded to it,
    # so they equal Whisper's features of the clip padded by hand.
    assert min_audio_samples(AudioSettings()) == 480
    assert audio_token_count(2) == 0 and audio_token_count(3) == 1
    x = _tone(440, 1.0, 16000)[:n]
    ours = log_mel(x)
    assert ours.shape == (128, 3) and num_feature_frames(n, AudioSettings()) == 3
    torch.testing.assert_close(ours, _whisper(np.pad(x, (0, 480 - n))), atol=WHISPER_TOL, rtol=0)
    # The streaming paths pad the same way.
    torch.testing.assert_close(log_mel_stream([x[: n // 2], x[n // 2 :]]), ours, atol=1e-6, rtol=0)
    stream = StreamingLogMel()
    chunks = stream.push(x) + stream.finish()
    assert len(chunks) == 1
    torch.testing.assert_close(chunks[0].features, ours, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="at least one sample"):
        log_mel(np.zeros(0, dtype=np.float32))
    with pytest.raises(ValueError, match="no audio samples"):
        log_mel_stream([np.zeros(0, dtype=np.float32)])


def test_a_10_ms_file_becomes_one_audio_token(tmp_path: Path) -> None:
    path = tmp_path / "click.wav"
    sf.write(path, _tone(1000, 0.01, 16000), 16000, subtype="PCM_16")
    item = {"prompt": "pitch? l h", "media": [{"modality": "audio", "path": str(path)}]}
    inputs = process_sample(item, TinyTokenizer())
    assert inputs["input_features"].shape == (1, 128, 3)
    assert inputs["feature_attention_mask"].tolist() == [[1, 1, 1]]
    assert int((inputs["input_ids"] == TINY_VOCAB.audio_pad_id).sum()) == 1
    torch.testing.assert_close(inputs["input_features"][0], log_mel(load_audio(path)), atol=1e-6, rtol=0)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_float_wav_with_nan_or_inf_is_a_media_error(tmp_path: Path, bad: float) -> None:
    x = _tone(440, 1.0, 16000)
    x[12345] = bad
    path = tmp_path / "bad.wav"
    sf.write(path, x, 16000, subtype="FLOAT")
    with pytest.raises(MediaError, match=r"non-finite sample .* at frame 12345") as info:
        load_audio(path)
    assert info.value.path == str(path) and info.value.modality == "audio"
    item = {"prompt": "pitch? l h", "media": [{"modality": "audio", "path": str(path)}]}
    with pytest.raises(MediaError, match="non-finite"):
        process_sample(item, TinyTokenizer())
    # In memory the same samples are a ValueError, whole or streamed.
    with pytest.raises(ValueError, match=r"non-finite sample .* at sample 12345"):
        log_mel(x)
    with pytest.raises(ValueError, match="at sample 12345"):
        log_mel_stream([x[:10000], x[10000:]])


def _late_loud_clip(seconds: float, rate: int) -> np.ndarray:
    # Quiet noise, then a tone 60 dB louder in the last quarter: the Whisper floor (max − 8) is set by
    # frames near the end, so a running maximum would floor the early frames differently.
    rng = np.random.default_rng(3)
    x = (1e-3 * rng.standard_normal(int(seconds * rate))).astype(np.float32)
    loud = _tone(700, seconds, rate, amp=0.9)
    x[-len(x) // 4 :] += loud[-len(x) // 4 :]
    return x


@pytest.mark.parametrize(("n", "max_block"), [(16000 * 5 + 77, 4000), (16000 * 3, 161), (5000, 100_000)])
def test_streamed_log_mel_equals_the_whole_clip_computation(n: int, max_block: int) -> None:
    x = _late_loud_clip(n / 16000, 16000)[:n]
    rng = np.random.default_rng(n)
    blocks, i = [], 0
    while i < n:
        k = int(rng.integers(0, max_block + 1))  # empty blocks too
        blocks.append(x[i : i + k])
        i += k
    streamed = log_mel_stream(iter(blocks))
    whole = log_mel(x)
    assert streamed.shape == whole.shape == (128, n // 160)
    torch.testing.assert_close(streamed, whole, atol=1e-5, rtol=0)
    assert float(whole.min()) == pytest.approx((float(whole.max()) * 4 - 4 - 8 + 4) / 4, abs=1e-5)  # floor active


def test_sample_processor_features_equal_whole_clip_log_mel(tmp_path: Path) -> None:
    # A 44.1 kHz stereo file through the processor (streamed, small blocks) against the whole-clip
    # computation: every sample decoded and resampled at once, then one log_mel.
    rate = 44100
    left = _late_loud_clip(4.0, rate)
    right = 0.5 * _tone(300, 4.0, rate)
    path = tmp_path / "st.flac"
    sf.write(path, np.stack([left, right], axis=1), rate, subtype="PCM_24")
    settings = ProcessorSettings(audio=AudioSettings(block_frames=3000))
    item = {"prompt": "pitch? l h", "media": [{"modality": "audio", "path": str(path)}]}
    feats = process_sample(item, TinyTokenizer(), settings)["input_features"][0]
    decoded = sf.read(path, dtype="float32", always_2d=True)[0].mean(axis=1, dtype=np.float32)
    whole = log_mel(resample(decoded, rate, 16000))
    assert feats.shape == whole.shape == (128, 400)
    torch.testing.assert_close(feats, whole, atol=1e-4, rtol=0)


def _processor_numpy_peak(path: Path, settings: ProcessorSettings) -> tuple[int, int]:
    # tracemalloc sees numpy's buffers (decoded and resampled samples, STFT inputs), not torch's
    # (the features, which the model input holds whatever the path): the working memory.
    item = {"prompt": "pitch? l h", "media": [{"modality": "audio", "path": str(path)}]}
    processor = SampleProcessor(TinyTokenizer(), settings)
    tracemalloc.start()
    frames = processor(item)["input_features"].shape[2]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak, frames


def test_sample_processor_audio_memory_does_not_grow_with_the_clip(tmp_path: Path) -> None:
    settings = ProcessorSettings(audio=AudioSettings(block_frames=8192))
    peaks = {}
    for seconds in (10, 10, 60):  # the first 10 s run warms caches (mel filters, window), not measured
        path = tmp_path / f"{seconds}.wav"
        sf.write(path, np.stack([_tone(440, seconds, 48000)] * 2, axis=1), 48000, subtype="PCM_16")
        peaks[seconds], frames = _processor_numpy_peak(path, settings)
        assert frames == seconds * 100
    # 6x the audio, not 6x the memory: the whole 60 s clip at 48 kHz stereo would be 23 MB as float32.
    assert peaks[60] < 1.3 * peaks[10], peaks
    assert peaks[60] < 2_000_000, peaks


@pytest.mark.parametrize(("rate", "seconds"), [(44100, 1.37), (32000, 0.7), (96000, 0.3), (16000, 0.5), (11025, 2.0)])
def test_expected_num_samples_is_what_the_stream_yields(tmp_path: Path, rate: int, seconds: float) -> None:
    path = tmp_path / "x.wav"
    sf.write(path, _tone(300, seconds, rate), rate, subtype="PCM_16")
    n = expected_num_samples(path, AudioSettings(block_frames=5000))
    assert n == len(load_audio(path, AudioSettings(block_frames=5000)))


@pytest.mark.parametrize("hint", [None, 16000 * 2 + 33, 16000 * 2 + 33 - 800, 16000 * 2 + 33 + 800])
def test_a_wrong_length_hint_changes_nothing(hint: int | None) -> None:
    # The hint only sizes the preallocated features; too short or too long, the result is the same.
    x = _late_loud_clip(2.0, 16000)
    x = np.concatenate([x, x[:33]])
    blocks = [x[i : i + 3000] for i in range(0, len(x), 3000)]
    torch.testing.assert_close(log_mel_stream(blocks, num_samples=hint), log_mel(x), atol=1e-5, rtol=0)
