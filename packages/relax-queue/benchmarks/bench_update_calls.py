"""A trainer's queue calls per update over the Ray transport: four calls against two, side by side in one run.

A GRPO trainer's update leases a batch of whole groups, holds it through the update, acks it and publishes its new
version. Settled call by call that is four actor round trips (get, renew the lease for the update's length, ack,
publish_version); with the lease length given at lease time (``get(lease_s=...)``) and the ack and the version in
one call (``ack_and_publish``) it is two. Both schemes run on one queue actor, alternating update by update, so
the machine's load falls on both alike; the script prints each scheme's median seconds of queue calls per update,
the round trips it counted (``RayQueueClient.round_trips``) and the ratio.

Run: ``uv run --no-sync python packages/relax-queue/benchmarks/bench_update_calls.py [--updates N]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

import ray

from relax_queue import BoundedStaleness, GroupBatcher, QueueConfig, RowInput, TaskSpec, create_ray_queue

GROUPS, GROUP_SIZE = 8, 16  # relax bench trl's default: 8 prompts x 16 completions an update
LEASE_S = 3600.0


def _rows(update: int) -> list[RowInput]:
    """One update's rows, shaped like the trainer's (a prompt, a one-token response, its log-prob, metadata)."""
    return [
        RowInput(
            f"u{update}/p{g}/{i}",
            {
                "prompt": [1, 5, 9, 12, 7, 3],
                "response": [17],
                "logprobs": [-2.5],
                "reward": float(i % 2),
                "meta": {"prompt_key": f"u{update}/p{g}", "task": "add"},
            },
            versions=update,
            group_id=f"u{update}/p{g}",
            group_size=GROUP_SIZE,
        )
        for g in range(GROUPS)
        for i in range(GROUP_SIZE)
    ]


def four_calls(client: Any, reader: Any, version: int) -> None:
    """get, renew for the update, ack, publish_version: the trainer's calls before ``ack_and_publish``."""
    batch = reader.get(timeout=30)
    reader.renew(batch, LEASE_S)
    reader.ack(batch)
    client.publish_version(version)


def two_calls(client: Any, reader: Any, version: int) -> None:
    """get with the update's lease length, then the ack with the version in one call."""
    batch = reader.get(timeout=30, lease_s=LEASE_S)
    reader.ack_and_publish(batch, version)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=200, help="updates per scheme (default 200)")
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        config = QueueConfig(
            tasks=(TaskSpec("trainer", check_staleness=True),),
            staleness=BoundedStaleness(tau=None, batch_size=GROUPS * GROUP_SIZE),
        )
        client = create_ray_queue("bench-update-calls", config)
        reader = client.reader("trainer", ["prompt", "response", "logprobs", "reward", "meta"], GroupBatcher(GROUPS))
        schemes: dict[str, Callable[[Any, Any, int], None]] = {"four calls": four_calls, "two calls": two_calls}
        seconds: dict[str, list[float]] = {name: [] for name in schemes}
        trips: dict[str, int] = dict.fromkeys(schemes, 0)
        version = 0
        for update in range(2 * args.updates + 10):
            name = list(schemes)[update % 2]  # alternate, so load falls on both alike
            client.put_many(_rows(update))
            version += 1
            before, start = client.round_trips, time.perf_counter()
            schemes[name](client, reader, version)
            elapsed = time.perf_counter() - start
            if update >= 10:  # the first updates warm the actor and the client up
                seconds[name].append(elapsed)
                trips[name] += client.round_trips - before
        assert client.version == version and len(client) == 0, "every batch consumed, every version published"
        print(f"queue calls per update over Ray, {GROUPS}x{GROUP_SIZE} rows, {args.updates} updates each, alternating")
        print("| scheme | round trips per update | median s | p90 s |")
        print("| --- | ---: | ---: | ---: |")
        for name, samples in seconds.items():
            p90 = sorted(samples)[int(0.9 * len(samples))]
            print(f"| {name} | {trips[name] / len(samples):.1f} | {statistics.median(samples):.4f} | {p90:.4f} |")
        ratio = statistics.median(seconds["two calls"]) / statistics.median(seconds["four calls"])
        print(f"two calls / four calls (median seconds per update): {ratio:.2f}x")
        client.shutdown()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
