"""The ``transferqueue`` (PyPI) contender, run by ``bench_queue.py`` inside its own virtual env.

Prints one JSON result per line, in ``bench_queue.py``'s format. Uses transferqueue's KV API
(``kv_put``/``kv_batch_put`` + ``kv_batch_get`` + ``kv_clear`` as one op, the closest match of
put + get + ack) with its default SimpleStorage backend on a local Ray instance.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable

# Ray workers start with this python rather than through `uv run`, and a busy 2-core box can
# take more than Ray's default 30 s to start a node.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("RAY_raylet_start_wait_time_s", "180")

import ray
import torch
import transfer_queue as tq
from tensordict import TensorDict

BATCH = 1000


def measure(workload: str, op: Callable[[int], None], ops: int, rows_per_op: int, row_bytes: int = 0) -> None:
    op(-1)
    lat = []
    start = time.perf_counter()
    for i in range(ops):
        t0 = time.perf_counter()
        op(i)
        lat.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - start
    lat.sort()
    rows = ops * rows_per_op
    print(
        json.dumps(
            {
                "transport": f"transferqueue {tq.__version__ if hasattr(tq, '__version__') else ''}".strip(),
                "workload": workload,
                "rows_per_s": rows / elapsed,
                "p50_ms": lat[len(lat) // 2] * 1e3,
                "p99_ms": lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e3,
                "gb_per_s": rows * row_bytes / elapsed / 1e9 if row_bytes else None,
            }
        ),
        flush=True,
    )


def main(scale: float) -> None:
    # transferqueue's controller and its 2 storage units reserve 1 CPU each: 4 logical CPUs on the same 2 cores.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, object_store_memory=2 * 2**30)
    tq.init()
    counter = [0]

    def single(i: int) -> None:
        counter[0] += 1
        key = f"k{counter[0]}"
        tq.kv_put(key, "p", fields={"x": torch.tensor([i])})
        tq.kv_batch_get([key], "p")
        tq.kv_clear([key], "p")

    def batched(i: int) -> None:
        keys = [f"k{counter[0] + j}" for j in range(BATCH)]
        counter[0] += BATCH
        tq.kv_batch_put(keys, "p", fields=TensorDict({"x": torch.arange(BATCH)}, batch_size=BATCH))
        tq.kv_batch_get(keys, "p")
        tq.kv_clear(keys, "p")

    # The array-column workload of _bench_arrays.py: three fields of shape (n, d), 188 bytes a row.
    for n in (100, 1000):
        arrays = TensorDict(
            {"obs": torch.rand(n, 32), "act": torch.rand(n, 7, dtype=torch.float64), "reward": torch.rand(n)},
            batch_size=n,
        )

        def arrays_op(i: int, n: int = n, arrays: TensorDict = arrays) -> None:
            keys = [f"k{counter[0] + j}" for j in range(n)]
            counter[0] += n
            tq.kv_batch_put(keys, "p", fields=arrays)
            tq.kv_batch_get(keys, "p")
            tq.kv_clear(keys, "p")

        ops = max(3, int((150 if n == 100 else 40) * scale))
        measure(f"numpy (n, d), {n} rows a call, self loop", arrays_op, ops, n, 188)
    measure("small, single", single, max(1, int(300 * scale)), 1)
    measure(f"small, batch {BATCH}", batched, max(1, int(20 * scale)), BATCH)
    for mb, count in ((1, max(1, int(100 * scale))), (16, max(1, int(20 * scale)))):
        tensor = torch.ones(mb * 2**20 // 8, dtype=torch.float64)

        def big(i: int, tensor: torch.Tensor = tensor) -> None:
            counter[0] += 1
            key = f"k{counter[0]}"
            tq.kv_put(key, "p", fields={"x": tensor})
            tq.kv_batch_get([key], "p")
            tq.kv_clear([key], "p")

        measure(f"{mb} MB array", big, count, 1, tensor.numel() * 8)
    tq.close()
    ray.shutdown()


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 1.0)
