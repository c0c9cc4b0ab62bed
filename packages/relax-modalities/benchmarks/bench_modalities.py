"""Side-by-side benchmark of the relax-modalities data paths (one run, one machine).

- image: images/s of `preprocess_image` against transformers' ``Qwen2VLImageProcessor`` (its PIL
  backend; the torchvision backend needs torchvision, which this workspace does not install) on the
  same in-memory images and settings, and from JPEG files (decode included on both sides);
- audio: real-time factor and peak memory of streaming log-mel features on a 10-minute 44.1 kHz
  stereo file (decode + mix-down + soxr resampling + features), against loading the whole file and
  running ``WhisperFeatureExtractor``;
- video: frames/s of `load_video` (decode + sampling + normalise + patchify) against raw decord
  ``get_batch`` of the same frames.

Run: ``OMP_NUM_THREADS=1 uv run --no-sync python packages/relax-modalities/benchmarks/bench_modalities.py``
(``--quick`` for a smaller run). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
import tracemalloc
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
from PIL import Image

from relax_modalities import (
    AudioSettings,
    ImageSettings,
    StreamingLogMel,
    VideoSettings,
    iter_audio_blocks,
    load_image,
    load_video,
    preprocess_image,
    probe_video,
)
from relax_modalities.synthetic import write_mp4


def _best_of(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _compare(ours: Callable[[], object], ref: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Best time of each side over ``repeats`` alternating runs (load on a shared box hits both alike)."""
    t_ours, t_ref = float("inf"), float("inf")
    for _ in range(repeats):
        t_ref = min(t_ref, _best_of(ref, 1))
        t_ours = min(t_ours, _best_of(ours, 1))
    return t_ours, t_ref


def _photo_like(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    # Smooth gradients plus noise: compresses like a photo, unlike pure noise.
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([(yy * 255 / h), (xx * 255 / w), ((yy + xx) * 127 / (h + w))], axis=-1)
    return np.clip(base + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)


def bench_image(tmp: Path, n: int, repeats: int) -> list[tuple[str, str, str, str]]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    rng = np.random.default_rng(0)
    sizes = [(480, 640), (224, 224), (720, 1280), (333, 517)]
    images = [Image.fromarray(_photo_like(rng, *sizes[i % len(sizes)])) for i in range(n)]
    paths = []
    for i, img in enumerate(images):
        p = tmp / f"{i}.jpg"
        img.save(p, quality=90)
        paths.append(p)
    settings = ImageSettings(max_pixels=448 * 448)
    ref = Qwen2VLImageProcessorPil(max_pixels=448 * 448)
    # equality on the benchmark images themselves
    diff = max(
        float((preprocess_image(im, settings).pixel_values - ref(images=[im], return_tensors="pt")["pixel_values"])
              .abs().max())
        for im in images[:4]
    )  # fmt: skip
    t_ours, t_ref = _compare(
        lambda: [preprocess_image(im, settings) for im in images],
        lambda: [ref(images=[im], return_tensors="pt") for im in images],
        repeats,
    )
    t_ours_f, t_ref_f = _compare(
        lambda: [preprocess_image(load_image(p), settings) for p in paths],
        lambda: [ref(images=[Image.open(p)], return_tensors="pt") for p in paths],
        repeats,
    )
    tiny = [Image.fromarray(_photo_like(rng, 56, 56)) for _ in range(4 * n)]
    t_ours_t, t_ref_t = _compare(
        lambda: [preprocess_image(im, settings) for im in tiny],
        lambda: [ref(images=[im], return_tensors="pt") for im in tiny],
        repeats,
    )
    return [
        ("image 56x56, synthetic-task size (images/s)", f"{len(tiny) / t_ours_t:.0f}", f"{len(tiny) / t_ref_t:.0f}",
         f"{t_ref_t / t_ours_t:.2f}x"),
        ("image 224-1280 px, in memory (images/s)", f"{n / t_ours:.0f}", f"{n / t_ref:.0f}", f"{t_ref / t_ours:.2f}x"),
        ("image 224-1280 px, from JPEG (images/s)", f"{n / t_ours_f:.0f}", f"{n / t_ref_f:.0f}",
         f"{t_ref_f / t_ours_f:.2f}x"),
        ("image, max abs diff vs reference", f"{diff:.1e}", "-", "-"),
    ]  # fmt: skip


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bench_audio(tmp: Path, minutes: float) -> list[tuple[str, str, str, str]]:
    from transformers import WhisperFeatureExtractor

    rate, seconds = 44_100, int(minutes * 60)
    path = tmp / "long.flac"
    rng = np.random.default_rng(1)
    with sf.SoundFile(path, "w", rate, 2, subtype="PCM_16") as f:
        for s in range(0, seconds, 10):  # written in 10 s pieces so the script itself stays small
            t = np.arange(s * rate, (s + 10) * rate) / rate
            x = 0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(len(t))
            f.write(np.stack([x, 0.5 * x], axis=1).astype(np.float32))
    settings = AudioSettings()

    def stream() -> int:
        buf = StreamingLogMel(settings)
        frames = 0
        for block in iter_audio_blocks(path, settings):
            frames += sum(c.features.shape[1] for c in buf.push(block))
        return frames + sum(c.features.shape[1] for c in buf.finish())

    tracemalloc.start()
    t = time.perf_counter()
    frames = stream()
    t_stream = time.perf_counter() - t
    peak_stream = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()

    fe = WhisperFeatureExtractor(feature_size=128)
    tracemalloc.start()
    t = time.perf_counter()
    whole, _ = sf.read(path, dtype="float32")
    import soxr

    mono = soxr.resample(whole.mean(axis=1), rate, 16_000, quality="VHQ")
    ref = fe(mono, sampling_rate=16_000, padding="longest", truncation=False, return_tensors="pt")
    t_ref = time.perf_counter() - t
    peak_ref = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    assert abs(frames - ref["input_features"].shape[-1]) <= 1, (frames, ref["input_features"].shape)
    return [
        (f"audio {minutes:g} min 44.1 kHz stereo, real-time factor", f"{t_stream / seconds:.4f}",
         f"{t_ref / seconds:.4f}", f"{t_ref / t_stream:.2f}x"),
        ("audio, peak traced memory (MiB)", f"{peak_stream:.1f}", f"{peak_ref:.1f}",
         f"{peak_ref / peak_stream:.0f}x less"),
    ]  # fmt: skip


def bench_video(tmp: Path, n_videos: int, repeats: int) -> list[tuple[str, str, str, str]]:
    import decord

    rng = np.random.default_rng(2)
    paths = []
    for i in range(n_videos):
        frames = np.stack([_photo_like(rng, 224, 224) for _ in range(8)])
        frames = np.concatenate([np.roll(frames, 7 * k, axis=2) for k in range(8)])  # 64 frames, 30 fps
        p = tmp / f"v{i}.mp4"
        write_mp4(p, frames, fps=30)
        paths.append(p)
    settings = VideoSettings(fps=8.0, max_pixels=224 * 224)
    plans = [probe_video(p, settings) for p in paths]
    total = sum(len(pl.frame_indices) for pl in plans)

    def raw() -> None:
        for p, pl in zip(paths, plans, strict=True):
            decord.VideoReader(str(p), ctx=decord.cpu(0), num_threads=1).get_batch(pl.frame_indices.tolist()).asnumpy()

    def ours() -> None:
        for p in paths:
            load_video(p, settings)

    t_ours, t_raw = _compare(ours, raw, repeats)
    return [("video 224x224, frames/s (decode+patchify vs raw get_batch)", f"{total / t_ours:.0f}",
             f"{total / t_raw:.0f}", f"{t_raw / t_ours:.2f}x")]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller inputs (1-minute audio, fewer images)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", FutureWarning)
    rows: list[tuple[str, str, str, str]] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        rows += bench_image(tmp, n=16 if args.quick else 64, repeats=5)
        rows += bench_audio(tmp, minutes=1.0 if args.quick else 10.0)
        rows += bench_video(tmp, n_videos=4 if args.quick else 12, repeats=5)
    print("| measure | relax-modalities | reference | ratio |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print(f"\npeak RSS of the whole run: {_rss_mb():.0f} MiB")


if __name__ == "__main__":
    main()
