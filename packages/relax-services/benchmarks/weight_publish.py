"""Publishing policy versions of SmolLM2-135M's shapes, with the time of a plain memory copy of the same bytes as
the yardstick: first every version's publish seconds through the in-process store (colocated mode; fresh buffers
per version, then recycled ones) and the Ray store (distributed mode) side by side; then, through Ray's object
store, a torch state dict (the old path) beside numpy buffers that readers map without copying (the path relax
takes), with the PSS of reader processes that load the version.

    python packages/relax-services/benchmarks/weight_publish.py [--versions 20] [--threads 1] [--readers 2]

The publication copies tensor by tensor with torch's intra-op threads: ``--threads`` sets them as ``run.threads``
does in a run (1 on 2 cores; more threads than free cores make each tensor's copy wait for a straggler).
"""

from __future__ import annotations

import argparse

import ray
import torch

from relax_services.bench.weight_publish import format_rows, format_versions, measure_publish, measure_versions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--readers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ray.init(include_dashboard=False, num_cpus=2, log_to_driver=False)
    try:
        print(format_versions(measure_versions(args.versions, args.layers)), flush=True)
        memcpy_s, rows = measure_publish(args.readers, args.repeats, args.layers)
    finally:
        ray.shutdown()
    print(format_rows(memcpy_s, rows))


if __name__ == "__main__":
    main()
