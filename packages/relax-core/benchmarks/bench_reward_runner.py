"""Overhead of the reward runner (routing, timeouts, fallback, counts) against calling the function directly.

Scores 4,096 responses with the ``exact_match`` built-in two ways, best of ``--repeats`` runs each,
alternating: a plain loop over the function and ``RewardRunner`` (sync calls on worker threads, each bounded
by ``timeout_s``). Prints µs per sample and the ratio.

Run: ``uv run --no-sync python packages/relax-core/benchmarks/bench_reward_runner.py``
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import relax_core as rc


def seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    requests = [rc.RewardRequest(f"answer {i}", f"answer {i % 2}", "bench") for i in range(args.samples)]
    responses = [r.response for r in requests]
    truths = [r.ground_truth for r in requests]
    with rc.build_reward_runner(rc.RewardRunnerConfig()) as runner:
        sides = {
            "plain loop": lambda: [rc.exact_match_reward(r, g) for r, g in zip(responses, truths, strict=True)],
            "RewardRunner": lambda: runner.score(requests),
        }
        times = dict.fromkeys(sides, float("inf"))
        for _ in range(args.repeats):  # alternate the sides so load changes hit them alike
            for name, side in sides.items():
                times[name] = min(times[name], seconds(side))
    print(f"{args.samples} samples, best of {args.repeats}, load average {os.getloadavg()[0]:.1f}\n")
    print("| path | µs per sample | × plain loop |")
    print("| --- | --- | --- |")
    for name, took in times.items():
        print(f"| {name} | {took / args.samples * 1e6:.2f} | {took / times['plain loop']:.2f} |")


if __name__ == "__main__":
    main()
