"""Publishing one policy version of SmolLM2-135M's shapes through Ray's object store: a torch state dict (the old
path) beside numpy buffers that readers map without copying (the path relax takes), with the time of a plain
memory copy of the same bytes as the yardstick and the PSS of reader processes that load the version.

    python packages/relax-services/benchmarks/weight_publish.py [--readers 2] [--repeats 3]
"""

from __future__ import annotations

import argparse

import ray

from relax_services.bench.weight_publish import format_rows, measure_publish


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=30)
    args = parser.parse_args()
    ray.init(include_dashboard=False, num_cpus=2, log_to_driver=False)
    try:
        memcpy_s, rows = measure_publish(args.readers, args.repeats, args.layers)
    finally:
        ray.shutdown()
    print(format_rows(memcpy_s, rows))


if __name__ == "__main__":
    main()
