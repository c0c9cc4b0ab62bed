"""Benchmark of the FSDP2 training engine: updates/s and samples/s at world size 1 and 2 on CPU (gloo), and the
bucketed weight sync's GB/s, on the default tiny thinker and one larger config, side by side.

Run: ``relax bench train [--updates 4] [--batch 16] [--models tiny wide]``. Each world size is a fresh group of
spawned processes on this machine; the figures are measured, never asserted (the machine may be loaded).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch and the models load in the benchmark's processes, not when the CLI parses its options
    import torch

    from relax_services.engines.protocols import LossInputs, TrainSample

MODELS: dict[str, dict[str, Any]] = {
    "tiny": {},
    "wide": {
        "hidden_size": 256,
        "num_layers": 4,
        "num_heads": 8,
        "num_kv_heads": 4,
        "ffn_size": 768,
        "mrope_section": (8, 4, 4),
    },
}
"""Model shapes benchmarked, as :class:`~relax_services.models.TinyOmniConfig` fields: the default thinker and
a wider, deeper one (≈3.6 M parameters)."""

BUCKET_BYTES = 1 << 20


@dataclass(frozen=True)
class TrainFigures:
    """Measured figures of one (model, world size)."""

    model: str
    parameters: int
    world_size: int
    updates_per_s: float
    samples_per_s: float
    sync_bytes: int
    sync_buckets: int
    sync_s: float
    sync_gb_per_s: float


def _batch(size: int, seed: int) -> list[TrainSample]:
    import torch

    from relax_services.engines.protocols import TrainSample
    from relax_services.models.synthetic import synthetic_prompt

    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(size):
        prompt = synthetic_prompt("image" if i % 4 == 0 else "text", [12 + i % 30, 40], gen)
        response = torch.randint(12, 48, (8,), generator=gen)
        out.append(TrainSample(prompt, response, {"advantages": torch.randn(8, generator=gen)}))
    return out


def _loss(inputs: LossInputs) -> torch.Tensor:
    return -(inputs.logprobs * inputs.fields["advantages"] * inputs.mask).sum() / inputs.mask.sum()


def _worker(rank: int, world: int, folder: str, model: str, updates: int, batch_size: int) -> None:
    import torch
    import torch.distributed as dist

    from relax_services.engines.fsdp.train import FSDPTrainEngine
    from relax_services.engines.torch.train import TorchTrainConfig
    from relax_services.models import TinyOmniConfig, build_tiny_omni, num_parameters
    from relax_services.weights.buckets import BucketLoader, InProcessWeightStream, stream_buckets

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    try:
        shape = TinyOmniConfig(**MODELS[model])
        engine = FSDPTrainEngine(build_tiny_omni(0, shape), TorchTrainConfig(micro_batch_size=4))
        batches = [_batch(batch_size, s) for s in range(updates + 1)]
        engine.step(batches[0], _loss)  # warm-up: first forwards allocate and initialise lazily
        dist.barrier()
        start = time.perf_counter()
        for b in batches[1:]:
            engine.step(b, _loss)
        seconds = time.perf_counter() - start
        target = build_tiny_omni(1, shape)
        stats = InProcessWeightStream([BucketLoader(target)], is_source=rank == 0).send(
            engine.version, stream_buckets(engine.model, BUCKET_BYTES)
        )
        if rank == 0:
            figures = TrainFigures(
                model=model,
                parameters=num_parameters(target),
                world_size=world,
                updates_per_s=updates / seconds,
                samples_per_s=updates * batch_size / seconds,
                sync_bytes=stats.num_bytes,
                sync_buckets=stats.num_buckets,
                sync_s=stats.seconds,
                sync_gb_per_s=stats.gb_per_s,
            )
            Path(folder, "figures.json").write_text(json.dumps(asdict(figures)))
    finally:
        dist.destroy_process_group()


def measure(model: str, world_size: int, updates: int = 4, batch_size: int = 16) -> TrainFigures:
    """Runs ``updates`` timed updates (after one warm-up) of ``model`` on a fresh group of ``world_size`` processes."""
    from torch.multiprocessing.spawn import start_processes

    with tempfile.TemporaryDirectory() as folder:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        start_processes(  # type: ignore[no-untyped-call]
            _worker, args=(world_size, folder, model, updates, batch_size), nprocs=world_size, start_method="spawn"
        )
        return TrainFigures(**json.loads(Path(folder, "figures.json").read_text()))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options (shared with ``relax bench train``)."""
    parser.add_argument("--updates", type=int, default=4, help="timed updates per run (after one warm-up)")
    parser.add_argument("--batch", type=int, default=16, help="samples per update (split over the ranks)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))


def main(argv: list[str] | None = None) -> None:
    """``relax bench train``: parse ``argv`` (the command line when None) and run the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> None:
    """Measures and prints the table for ``args.models`` at world size 1 and 2."""
    header = ("model", "params", "N", "updates/s", "samples/s", "sync MB", "buckets", "GB/s")
    print("{:6} {:>9} {:>2} {:>10} {:>10} {:>8} {:>7} {:>7}".format(*header))
    for model in args.models:
        rows = [measure(model, n, args.updates, args.batch) for n in (1, 2)]
        for f in rows:
            print(
                f"{f.model:6} {f.parameters:9d} {f.world_size:2d} {f.updates_per_s:10.3f} {f.samples_per_s:10.2f} "
                f"{f.sync_bytes / 1e6:8.2f} {f.sync_buckets:7d} {f.sync_gb_per_s:7.3f}"
            )
        print(f"{model}: updates/s at N=2 / N=1 = {rows[1].updates_per_s / rows[0].updates_per_s:.2f}")


if __name__ == "__main__":
    main()
