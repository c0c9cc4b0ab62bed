"""Peak memory of the audio path against clip length: streamed (what the loader runs) vs whole-clip.

For each clip length (48 kHz stereo 16-bit WAV, a tone plus noise) each side runs in a fresh
process: imports, one warm-up on a 1 s clip, the peak-RSS counter reset (Linux ``clear_refs``), then
one clip, and the process's peak RSS growth over its RSS before the clip is reported.

- streamed: `SampleProcessor` on an audio item, the path `build_loader` runs: `iter_audio_blocks`
  (bounded reads, mono, soxr stream) → `log_mel_stream` (log-mel block by block, floored at the end);
- whole-clip: the previous path, ``log_mel(load_audio(path))``: every sample decoded and resampled,
  then one STFT over the whole clip.

Both give the same features (tested to 1e-4; printed here as the max abs difference on the shortest
clip). The features themselves, ``128 × 100`` float32 per second (50 KiB/s, 0.05 MiB/s), are the
output and grow with the clip on either side; the table lists them.

Run: ``OMP_NUM_THREADS=1 uv run --no-sync python packages/relax-modalities/benchmarks/bench_audio_memory.py``
(``--minutes 1 5 20`` by default).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile as sf

RATE = 48_000


def _write_clip(path: Path, seconds: float) -> None:
    """48 kHz stereo PCM_16, written in one-minute blocks so the writer's memory stays small."""
    rng = np.random.default_rng(0)
    block = 60 * RATE
    with sf.SoundFile(path, "w", samplerate=RATE, channels=2, subtype="PCM_16") as f:
        done, total = 0, int(seconds * RATE)
        while done < total:
            n = min(block, total - done)
            t = (done + np.arange(n)) / RATE
            tone = 0.3 * np.sin(2 * np.pi * 440.0 * t)
            f.write(np.stack([tone + 0.01 * rng.standard_normal(n), 0.5 * tone], axis=1).astype(np.float32))
            done += n


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _child(mode: str, path: str, warm: str) -> None:
    import torch

    from relax_modalities import ProcessorSettings, SampleProcessor, load_audio, log_mel
    from relax_modalities.text import TinyTokenizer

    torch.set_num_threads(1)
    processor = SampleProcessor(TinyTokenizer(), ProcessorSettings())

    def run(p: str) -> torch.Tensor:
        if mode == "streamed":
            item = {"prompt": "pitch? l h", "media": [{"modality": "audio", "path": p}]}
            return processor(item)["input_features"][0]
        return log_mel(load_audio(p))

    run(warm)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM (peak RSS) to the current RSS
    before = _status_kib("VmRSS")
    t0 = time.perf_counter()
    feats = run(path)
    seconds = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    if os.environ.get("BENCH_SAVE"):
        np.save(path + f".{mode}.npy", feats.numpy())
    print(json.dumps({"growth_mib": (peak - before) / 1024, "seconds": seconds, "frames": feats.shape[1]}))


def _measure(mode: str, path: Path, warm: Path, save: bool = False) -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"BENCH_SAVE": "1"} if save else {})}
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, str(path), str(warm)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, nargs="+", default=[1.0, 5.0, 20.0])
    parser.add_argument("--child", nargs=3, metavar=("MODE", "PATH", "WARM"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(*args.child)
        return
    print(f"# audio path peak memory, 48 kHz stereo 16-bit WAV; load average {os.getloadavg()[0]:.1f}\n")
    print("| clip | features (MiB) | streamed: peak growth (MiB) | whole-clip: peak growth (MiB) | ratio |"
          " streamed RTF | whole-clip RTF |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        warm = Path(tmp) / "warm.wav"
        _write_clip(warm, 1.0)
        for i, minutes in enumerate(args.minutes):
            path = Path(tmp) / f"{minutes:g}min.wav"
            _write_clip(path, minutes * 60)
            streamed = _measure("streamed", path, warm, save=i == 0)
            whole = _measure("whole-clip", path, warm, save=i == 0)
            if i == 0:
                a = np.load(str(path) + ".streamed.npy")
                b = np.load(str(path) + ".whole-clip.npy")
                diff = float(np.abs(a - b).max())
            feats_mib = 128 * streamed["frames"] * 4 / 2**20
            seconds = minutes * 60
            print(
                f"| {minutes:g} min | {feats_mib:.1f} | {streamed['growth_mib']:.1f} | {whole['growth_mib']:.1f} | "
                f"{whole['growth_mib'] / max(streamed['growth_mib'], 1e-9):.1f}× less | "
                f"{streamed['seconds'] / seconds:.4f} | {whole['seconds'] / seconds:.4f} |"
            )
            path.unlink()
    print(f"\nmax abs difference streamed vs whole-clip features ({args.minutes[0]:g} min): {diff:.1e}")


if __name__ == "__main__":
    main()
