"""Side-by-side throughput and latency of relax-queue against other queues, in one run.

Rows/s and p50/p99 latency for small rows; GB/s for 1 MB and 16 MB array rows. Producer and
consumer are the same (driver) process for every contender, so all pay the same costs:

- in-process: ``TransferQueue`` vs ``queue.Queue``;
- Ray: the relax Ray transport vs ``ray.util.queue.Queue`` (single and batched) and raw
  ``ray.put``/``ray.get`` (one array a call; a bulk of distinct arrays, one put each and one get;
  the same bulk as one list in one put: the cheapest way Ray offers to move them);
- the anchor, ``transferqueue`` from PyPI, measured by ``_tq_bench.py`` in its own virtual
  environment when ``--tq-python`` points at one (never a project dependency).

One "row" op = put + get (+ ack for relax). Latency is per op for single rows and per batch of
1000 for batched rows. "columns" rows use the columnar bulk API (``put_columns`` + ``get_columns``
+ ack): keys and one value list per field in, columns out, no per-row input or output object; on
Ray they ack each batch inside the next ``get_columns`` (``ack=previous``: two round trips an op,
as ``ray.util.queue``'s put + get, instead of three).
``--repeat N`` runs every contender N times in turn and keeps each one's best run. The array-column
workloads (numpy ``(n, d)`` fields, self loop, actor -> actor, a GRPO-like trace) live in
``_bench_arrays.py``; ``--suite arrays`` runs only those (and the bulk tensor rows the targets need).
Run: ``uv run --no-sync python packages/relax-queue/benchmarks/bench_queue.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Ray workers start with this python rather than through `uv run`, and a busy 2-core box can
# take more than Ray's default 30 s to start a node.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("RAY_raylet_start_wait_time_s", "180")

import numpy as np

from relax_queue import Capacity, QueueConfig, RowInput, TaskSpec, TransferQueue, create_ray_queue

sys.path.insert(0, str(Path(__file__).parent))
import _bench_arrays

BATCH = 1000
Result = dict[str, Any]


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3


def measure(
    name: str, workload: str, op: Callable[[int], None], ops: int, rows_per_op: int, row_bytes: int = 0
) -> Result:
    """Run ``op(i)`` ``ops`` times; return rows/s, GB/s and latency percentiles per op."""
    op(-1)  # warm-up
    lat: list[float] = []
    start = time.perf_counter()
    for i in range(ops):
        t0 = time.perf_counter()
        op(i)
        lat.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - start
    rows = ops * rows_per_op
    return {
        "transport": name,
        "workload": workload,
        "rows_per_s": rows / elapsed,
        "p50_ms": _pct(lat, 0.5),
        "p99_ms": _pct(lat, 0.99),
        "gb_per_s": rows * row_bytes / elapsed / 1e9 if row_bytes else None,
    }


def _relax_queue() -> TransferQueue:
    return TransferQueue(QueueConfig(tasks=(TaskSpec("c"),), capacity=Capacity(max_rows=None)))


def bench_in_process(scale: float) -> list[Result]:
    out: list[Result] = []
    n_single, n_batched = int(50_000 * scale), max(1, int(200 * scale))

    qq: queue.Queue[Any] = queue.Queue()

    def qq_single(i: int) -> None:
        qq.put({"x": i})
        qq.get()

    def qq_batched(i: int) -> None:
        for j in range(BATCH):
            qq.put({"x": j})
        for _ in range(BATCH):
            qq.get()

    out.append(measure("queue.Queue", "small, single", qq_single, n_single, 1))
    out.append(measure("queue.Queue", f"small, loop of {BATCH}", qq_batched, n_batched, BATCH))

    tq = _relax_queue()
    reader = tq.reader("c", ["x"])
    key = [0]

    def relax_single(i: int) -> None:
        key[0] += 1
        tq.put(key[0], {"x": i})
        reader.ack(reader.get(1, timeout=0))

    def relax_batched(i: int) -> None:
        base = key[0]
        key[0] += BATCH
        tq.put_many([RowInput(base + 1 + j, {"x": j}) for j in range(BATCH)])
        reader.ack(reader.get(BATCH, timeout=0))

    values = list(range(BATCH))

    def relax_columns(i: int) -> None:
        base = key[0]
        key[0] += BATCH
        tq.put_columns(range(base + 1, base + 1 + BATCH), {"x": values})
        reader.ack(reader.get_columns(BATCH, timeout=0))

    out.append(measure("relax in-process", "small, single", relax_single, n_single, 1))
    out.append(measure("relax in-process", f"small, batch {BATCH}", relax_batched, n_batched, BATCH))
    out.append(measure("relax in-process columns", f"small, batch {BATCH}", relax_columns, n_batched, BATCH))

    for mb, count in ((1, int(200 * scale)), (16, int(40 * scale))):
        arr = np.ones(mb * 2**20 // 8)

        def qq_tensor(i: int, arr: Any = arr) -> None:
            qq.put(arr)
            qq.get()

        def relax_tensor(i: int, arr: Any = arr) -> None:
            key[0] += 1
            tq.put(key[0], {"x": arr})
            reader.ack(reader.get(1, timeout=0))

        out.append(measure("queue.Queue", f"{mb} MB array", qq_tensor, max(count, 1), 1, arr.nbytes))
        out.append(measure("relax in-process", f"{mb} MB array", relax_tensor, max(count, 1), 1, arr.nbytes))
    return out


def bench_ray(scale: float, tensors_only: bool = False) -> list[Result]:
    import ray
    from ray.util.queue import Queue as RayUtilQueue

    out: list[Result] = []
    n_single, n_batched = max(1, int(300 * scale)), max(1, int(20 * scale))

    rq = RayUtilQueue(actor_options={"num_cpus": 0})

    def rq_single(i: int) -> None:
        rq.put({"x": i})
        rq.get()

    def rq_batched(i: int) -> None:
        rq.put_nowait_batch([{"x": j} for j in range(BATCH)])
        rq.get_nowait_batch(BATCH)

    if not tensors_only:
        out.append(measure("ray.util.queue", "small, single", rq_single, n_single, 1))
        out.append(measure("ray.util.queue", f"small, batch {BATCH}", rq_batched, n_batched, BATCH))

    clients = {
        durable: create_ray_queue(
            f"bench-{durable}",
            QueueConfig(tasks=(TaskSpec("c"),), capacity=Capacity(max_rows=None)),
            durable_payloads=durable,
        )
        for durable in (True, False)
    }
    client = clients[True]
    reader = client.reader("c", ["x"])
    key = [0]

    def relax_single(i: int) -> None:
        key[0] += 1
        client.put(key[0], {"x": i})
        reader.ack(reader.get(1, timeout=10))

    def relax_batched(i: int) -> None:
        base = key[0]
        key[0] += BATCH
        client.put_many([RowInput(base + 1 + j, {"x": j}) for j in range(BATCH)])
        reader.ack(reader.get(BATCH, timeout=10))

    values = list(range(BATCH))
    held: list[Any] = [None]  # the batch leased by the previous op, acked by the next get

    def relax_columns(i: int) -> None:
        base = key[0]
        key[0] += BATCH
        client.put_columns(range(base + 1, base + 1 + BATCH), {"x": values})
        held[0] = reader.get_columns(BATCH, timeout=10, ack=held[0])

    big = 10 * BATCH
    big_values = list(range(big))

    def rq_big(i: int) -> None:
        rq.put_nowait_batch([{"x": j} for j in big_values])
        rq.get_nowait_batch(big)

    def relax_columns_big(i: int) -> None:
        base = key[0]
        key[0] += big
        client.put_columns(range(base + 1, base + 1 + big), {"x": big_values})
        held[0] = reader.get_columns(big, timeout=10, ack=held[0])

    if not tensors_only:
        out.append(measure("relax Ray", "small, single", relax_single, n_single, 1))
        out.append(measure("relax Ray", f"small, batch {BATCH}", relax_batched, n_batched, BATCH))
        out.append(measure("relax Ray columns", f"small, batch {BATCH}", relax_columns, n_batched, BATCH))
        n_big = max(1, n_batched // 4)
        out.append(measure("ray.util.queue", f"small, batch {big}", rq_big, n_big, big))
        out.append(measure("relax Ray columns", f"small, batch {big}", relax_columns_big, n_big, big))
        reader.ack(held[0])  # the last op's batch
        held[0] = None

    @ray.remote(num_cpus=0)
    class Holder:
        """The least a durable queue must do with Ray >= 2.56 (no ``ray.put(_owner=)``): a process that outlives
        the producer takes its object and puts a copy of its own, and the consumer gets that copy."""

        def adopt(self, refs: list[Any]) -> list[Any]:
            return [ray.put(value) for value in ray.get(refs)]

    holder = Holder.remote()

    # (row size MB, rows, rows per bulk op); the one-row contenders run once per row size.
    tensor_runs = (
        (1, max(1, int(100 * scale)), 16),
        (16, max(1, int(20 * scale)), 4),
        (16, max(1, int(48 * scale)), 8),
    )
    if tensors_only:
        tensor_runs = tensor_runs[1:2]
    for run, (mb, count, bulk) in enumerate(tensor_runs):
        first_of_size = all(size != mb for size, _, _ in tensor_runs[:run])
        arr = np.ones(mb * 2**20 // 8)
        # Distinct arrays for the bulk ops: one object holding the same array twice would store it once.
        arrs = [np.full(mb * 2**20 // 8, float(j)) for j in range(bulk)]

        def raw(i: int, arr: Any = arr) -> None:
            ray.get(ray.put(arr))

        def raw_adopted(i: int, arr: Any = arr) -> None:
            ray.get(ray.get(holder.adopt.remote([ray.put(arr)]))[0])

        def raw_bulk(i: int, arrs: Any = arrs) -> None:
            ray.get([ray.put(a) for a in arrs])

        def raw_list(i: int, arrs: Any = arrs) -> None:
            ray.get(ray.put(arrs))

        def rq_tensor(i: int, arr: Any = arr) -> None:
            rq.put(arr)
            rq.get()

        ops = max(1, count // bulk)
        if first_of_size:
            out.append(measure("raw ray.put/get", f"{mb} MB array", raw, count, 1, arr.nbytes))
            out.append(
                measure("raw ray.put, copied by an actor, get", f"{mb} MB array", raw_adopted, count, 1, arr.nbytes)
            )
        out.append(measure("raw ray.put/get", f"{mb} MB array, bulk {bulk}", raw_bulk, ops, bulk, arr.nbytes))
        out.append(
            measure("raw ray.put/get of one list", f"{mb} MB array, bulk {bulk}", raw_list, ops, bulk, arr.nbytes)
        )
        if first_of_size:
            out.append(measure("ray.util.queue", f"{mb} MB array", rq_tensor, count, 1, arr.nbytes))
        for durable, c in clients.items():
            r = c.reader("c", ["x"])

            def relax_tensor(i: int, arr: Any = arr, c: Any = c, r: Any = r) -> None:
                key[0] += 1
                c.put(key[0], {"x": arr})
                held[0] = r.get(1, timeout=30, ack=held[0])  # two round trips an op, as the contenders

            def relax_tensor_columns(i: int, arrs: Any = arrs, c: Any = c, r: Any = r, bulk: int = bulk) -> None:
                base = key[0]
                key[0] += bulk
                c.put_columns(range(base + 1, base + 1 + bulk), {"x": arrs})
                held[0] = r.get_columns(bulk, timeout=30, ack=held[0])

            label = "relax Ray" + ("" if durable else " (durable_payloads=False)")
            if first_of_size:
                out.append(measure(label, f"{mb} MB array", relax_tensor, count, 1, arr.nbytes))
                r.ack(held[0])
                held[0] = None
            out.append(
                measure(
                    label.replace("relax Ray", "relax Ray columns"),
                    f"{mb} MB array, bulk {bulk}",
                    relax_tensor_columns,
                    ops,
                    bulk,
                    arr.nbytes,
                )
            )
            r.ack(held[0])
            held[0] = None
    for c in clients.values():
        c.shutdown()
    ray.kill(rq.actor)
    ray.kill(holder)
    return out


def bench_transferqueue(python: str, scale: float) -> list[Result]:
    script = Path(__file__).with_name("_tq_bench.py")
    proc = subprocess.run([python, str(script), str(scale)], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        print(f"transferqueue benchmark failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
        return []
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def best_of(runs: list[list[Result]]) -> list[Result]:
    """Each contender's fastest run (the runs list the contenders in the same order)."""
    return [max(same, key=lambda r: r["rows_per_s"]) for same in zip(*runs, strict=True)]


def median_of(runs: list[list[Result]]) -> list[Result]:
    """Each contender's median over the runs (rows/s, GB/s and latencies each the median of its own);
    ``repeats`` lists every run's rows/s, so a reader can see the spread."""
    out: list[Result] = []
    for same in zip(*runs, strict=True):
        merged = dict(same[0])
        for key in ("rows_per_s", "p50_ms", "p99_ms", "gb_per_s"):
            values = sorted(r[key] for r in same if r[key] is not None and r[key] == r[key])
            if values:
                merged[key] = statistics.median(values)
        merged["repeats"] = [r["rows_per_s"] for r in same]
        out.append(merged)
    return out


def table(results: list[Result]) -> str:
    lines = [
        "| transport | workload | rows/s | p50 ms/op | p99 ms/op | GB/s |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        gbs = f"{r['gb_per_s']:.2f}" if r["gb_per_s"] is not None else ""
        cells = [
            r["transport"],
            r["workload"],
            f"{r['rows_per_s']:,.0f}",
            "" if r["p50_ms"] != r["p50_ms"] else f"{r['p50_ms']:.3f}",  # NaN: throughput-only rows
            "" if r["p99_ms"] != r["p99_ms"] else f"{r['p99_ms']:.3f}",
            gbs,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _find(results: list[Result], transport: str, workload: str) -> Result | None:
    return next((r for r in results if r["transport"] == transport and r["workload"] == workload), None)


def targets(results: list[Result]) -> str:
    """The measured ratios against the package's speed targets (where this run measured both sides)."""
    lines: list[str] = []

    def ratio(label: str, a: Result | None, b: Result | None, key: str, goal: str, invert: bool = False) -> None:
        if a is None or b is None or not b[key]:
            return
        value = b[key] / a[key] if invert else a[key] / b[key]
        lines.append(f"- {label}: {value:.2f} (target {goal})")

    relax, rq, piped = "relax Ray columns", "ray.util.queue, whole batch", "relax Ray columns, pipelined puts"
    # The median op resists the load spikes of a shared machine better than the mean throughput.
    self_loop = "numpy (n, d), 1000 rows a call, self loop"
    for mine in (relax, piped):
        ratio(
            f"{mine} vs ray.util.queue, {self_loop}, by median op",
            _find(results, mine, self_loop),
            _find(results, rq, self_loop),
            "p50_ms",
            ">= 1.0x",
            invert=True,
        )
    inproc_p50 = _find(results, "relax in-process columns", "numpy (n, d), 1000 rows a call")
    if inproc_p50 is not None:
        lines.append(
            f"- in-process numpy columns, 1000 rows a call, by median op: "
            f"{1000 / inproc_p50['p50_ms'] * 1e3:,.0f} rows/s (target >= 1,000,000)"
        )
    for workload in (self_loop, "numpy (n, d), 1000 rows a call, actor -> actor"):
        for mine in (relax, piped):
            ratio(
                f"{mine} vs ray.util.queue, {workload}",
                _find(results, mine, workload),
                _find(results, rq, workload),
                "rows_per_s",
                ">= 1.0x",
            )
    tq_name = next((r["transport"] for r in results if r["transport"].startswith("transferqueue")), "")
    ratio(
        f"Ray batched vs {tq_name or 'transferqueue'}, {self_loop}",
        _find(results, relax, self_loop),
        _find(results, tq_name, self_loop),
        "rows_per_s",
        ">= 10x",
    )
    grpo = next((r["workload"] for r in results if r["workload"].startswith("GRPO")), "")
    ratio(
        "GRPO-like trace vs ray.util.queue",
        _find(results, relax, grpo),
        _find(results, rq, grpo),
        "rows_per_s",
        ">= 1.0x",
    )
    inproc = _find(results, "relax in-process columns", "numpy (n, d), 1000 rows a call")
    if inproc is not None:
        lines.append(
            f"- in-process numpy columns, 1000 rows a call: {inproc['rows_per_s']:,.0f} rows/s (target >= 1,000,000)"
        )
    single = _find(results, relax, "numpy (n, d), 1 rows a call, self loop")
    if single is not None and "calls_per_op" in single:
        lines.append(f"- single-row Ray put+get: {single['calls_per_op']:.2f} actor calls an op, counted (target 2)")
    for mine in (relax, piped, rq):
        ratio(
            f"single-row put+get p50 in actor round trips, {mine}",
            _find(results, mine, "numpy (n, d), 1 rows a call, self loop"),
            _find(results, "actor round trip", "no-op call"),
            "p50_ms",
            "<= 2",
        )
    for mine, raw in (
        (("relax Ray columns", "16 MB array, bulk 4"), ("raw ray.put/get", "16 MB array, bulk 4")),
        (("relax Ray", "16 MB array"), ("raw ray.put/get", "16 MB array")),
    ):
        ratio(
            f"{mine[0]} {mine[1]} (durable) vs {raw[0]}",
            _find(results, *mine),
            _find(results, *raw),
            "gb_per_s",
            ">= 0.8x",
        )
    ratio(
        "the durable lower bound (raw ray.put, copied by an actor, get) vs raw ray.put/get, 16 MB",
        _find(results, "raw ray.put, copied by an actor, get", "16 MB array"),
        _find(results, "raw ray.put/get", "16 MB array"),
        "gb_per_s",
        "what 0.8x would need",
    )
    ratio(
        "relax Ray 16 MB array (durable) vs that lower bound",
        _find(results, "relax Ray", "16 MB array"),
        _find(results, "raw ray.put, copied by an actor, get", "16 MB array"),
        "gb_per_s",
        "-> 1.0x",
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every op count (0.1 for a smoke run)")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray contenders")
    parser.add_argument("--tq-python", default=None, help="python of a venv with transferqueue installed")
    parser.add_argument("--repeat", type=int, default=1, help="runs of every contender, in turn")
    parser.add_argument(
        "--keep", choices=("best", "median"), default="best", help="of the repeated runs, keep each contender's..."
    )
    parser.add_argument("--suite", choices=("all", "arrays"), default="all", help="arrays: the array workloads only")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.time()
    arrays_only = args.suite == "arrays"
    keep = best_of if args.keep == "best" else median_of
    results = [] if arrays_only else keep([bench_in_process(args.scale) for _ in range(args.repeat)])
    results += keep([_bench_arrays.bench_in_process(measure, args.scale) for _ in range(args.repeat)])
    if not args.no_ray:
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=2 * 2**30)
        try:
            results += keep([_bench_arrays.bench_ray_self_loop(ray, measure, args.scale) for _ in range(args.repeat)])
            results += keep([_bench_arrays.bench_ray_actors(ray, args.scale) for _ in range(args.repeat)])
            results += keep([bench_ray(args.scale, tensors_only=arrays_only) for _ in range(args.repeat)])
        finally:
            ray.shutdown()
    if args.tq_python:
        tq = bench_transferqueue(args.tq_python, args.scale)
        results += tq
        if not tq:
            print("transferqueue: could not run here (see the error above)", file=sys.stderr)
    print(table(results))
    spread = [r for r in results if len(r.get("repeats", ())) > 1]
    if spread:
        print("\nrows/s of each run (median kept):")
        for r in spread:
            print(f"- {r['transport']}, {r['workload']}: " + ", ".join(f"{v:,.0f}" for v in r["repeats"]))
    print("\nAgainst the targets (measured in this run):\n" + targets(results))
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\n(total {time.time() - t0:.0f} s, {os.cpu_count()} CPUs, load average {load}, scale {args.scale})")


if __name__ == "__main__":
    main()
