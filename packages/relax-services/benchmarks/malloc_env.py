"""What glibc malloc settings cost and save in a model process: PSS, anonymous PSS and the median update time of the
torch training engine on the default tiny thinker, with and without them, side by side (by default the actors' own,
``_ray_init.ACTOR_ENV``; ``--settings`` compares others).

Each round starts two fresh Python processes, one per setting, in alternating order so that a change of machine
load hits both alike; each builds the model and the engine, runs a warm-up update and then ``--updates`` timed
ones on mixed image, audio and text batches (as the Trainer does in the default run), and reads its own
``/proc/self/smaps_rollup``. The script prints the medians and the ratios (with / without).

    uv run python packages/relax-services/benchmarks/malloc_env.py --rounds 4
    uv run python packages/relax-services/benchmarks/malloc_env.py --rounds 4 \
        --settings MALLOC_ARENA_MAX=2,MALLOC_MMAP_THRESHOLD_=131072,MALLOC_TRIM_THRESHOLD_=1048576

Measured (4 rounds of 8 updates of 64 samples, load 7-20 on 2 cores): ``MALLOC_ARENA_MAX=2`` alone, anonymous PSS
ratio 0.997 and update time 0.83 (no slowdown; one thread computes here, so the bound has little to bound); with
the fixed mmap and trim thresholds added, anonymous PSS 0.986 and update time 1.18, which is why the actors do
without them. Linux only (glibc and ``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from relax_services.hosting.ray_init import ACTOR_ENV

MALLOC = {key: value for key, value in ACTOR_ENV.items() if key.startswith("MALLOC_")}

_CHILD = """
import json, statistics, time
import torch
from relax_services.engines.protocols import TrainSample
from relax_services.engines.torch.train import TorchTrainConfig, TorchTrainEngine
from relax_services.models import build_tiny_omni
from relax_services.models.synthetic import synthetic_prompt

torch.set_num_threads(1)
MODALITIES = ("image", "audio", "text", "text")


def batch(size, seed):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(size):
        prompt = synthetic_prompt(MODALITIES[i % 4], [12 + i % 30, 40], gen)
        response = torch.randint(12, 48, (8,), generator=gen)
        out.append(TrainSample(prompt, response, {{"advantages": torch.randn(8, generator=gen)}}))
    return out


def loss(inputs):
    return -(inputs.logprobs * inputs.fields["advantages"] * inputs.mask).sum() / inputs.mask.sum()


def smaps():
    out = {{}}
    for line in open("/proc/self/smaps_rollup"):
        parts = line.split()
        if len(parts) == 3 and parts[2] == "kB":
            out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


engine = TorchTrainEngine(build_tiny_omni(0), TorchTrainConfig(micro_batch_size={micro}))
engine.step(batch({batch}, 0), loss)  # warm-up: the first forwards allocate lazily
seconds = []
for seed in range(1, {updates} + 1):
    b = batch({batch}, seed)
    t0 = time.perf_counter()
    engine.step(b, loss)
    seconds.append(time.perf_counter() - t0)
mem = smaps()
print(json.dumps({{"step_s": statistics.median(seconds), "pss": mem["Pss"], "pss_anon": mem["Pss_Anon"]}}))
"""


def measure(with_settings: bool, updates: int, batch: int, micro: int, settings: dict[str, str]) -> dict[str, float]:
    """One fresh process, with or without ``settings`` in its environment (glibc reads them at start-up)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_")}
    env["OMP_NUM_THREADS"] = "1"
    if with_settings:
        env.update(settings)
    code = _CHILD.format(updates=updates, batch=batch, micro=micro)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--updates", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64, help="samples per update")
    parser.add_argument("--micro", type=int, default=32, help="samples per forward/backward")
    parser.add_argument("--settings", default=None, help="KEY=VALUE,... to compare instead of the actors' own")
    args = parser.parse_args(argv)
    settings = MALLOC if args.settings is None else dict(kv.split("=", 1) for kv in args.settings.split(","))
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for r in range(args.rounds):
        for setting in (True, False) if r % 2 == 0 else (False, True):
            runs[setting].append(measure(setting, args.updates, args.batch, args.micro, settings))
    print(f"settings: {' '.join(f'{k}={v}' for k, v in settings.items())}  ({args.rounds} rounds, load {_load()})")
    medians = {s: {k: statistics.median(run[k] for run in runs[s]) for k in runs[s][0]} for s in runs}
    for key, unit, scale in (("pss", "MB", 2**-20), ("pss_anon", "MB", 2**-20), ("step_s", "s", 1.0)):
        with_, without = medians[True][key], medians[False][key]
        ratio = with_ / without
        print(f"{key:9s} with {with_ * scale:8.3f} {unit}  without {without * scale:8.3f} {unit}  ratio {ratio:.3f}")
    return 0


def _load() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
