"""Array-column workloads of ``bench_queue.py``: the way a non-RL user hands a batch to a queue.

Three numpy fields of shape ``(n, d)`` (188 bytes a row) at 1, 100 and 1000 rows a call:

- in-process: ``TransferQueue.put_columns`` + ``get_columns`` + ack vs ``queue.Queue`` carrying the batch;
- Ray self loop (the driver puts and gets) and producer actor -> consumer actor: the relax Ray client
  (``put_columns``, ``get_columns(ack=previous)``) vs ``ray.util.queue`` carrying the whole batch
  (a dict of the three arrays) as one item;
- a GRPO-like trace: 4 producer actors put groups of 8 rows, one consumer actor takes 4 whole
  groups a batch (relax: ``GroupBatcher(4)``; ``ray.util.queue``: one item per group, 4 gets);
- one actor round trip (a no-op actor call) measured in the same run, the unit for single-row latency.

Every relax workload over Ray runs twice: with the default client, and with ``pipeline_puts=True`` (a put
returns once submitted; the next get is served after it).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from relax_queue import (
    Capacity,
    FixedSizeBatcher,
    GroupBatcher,
    QueueConfig,
    RayQueueClient,
    TaskSpec,
    TransferQueue,
    connect,
    create_ray_queue,
)

Result = dict[str, Any]
Measure = Callable[..., Result]
ROW_BYTES = 32 * 4 + 7 * 8 + 4  # obs float32 x 32, act float64 x 7, reward float32: 188 bytes
SIZES = (1, 100, 1000)
GROUP, PRODUCERS, GROUPS_PER_BATCH = 8, 4, 4


def columns(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """The three fields of ``n`` rows."""
    rng = np.random.default_rng(seed)
    return {
        "obs": rng.random((n, 32), dtype=np.float32),
        "act": rng.random((n, 7)),
        "reward": rng.random(n, dtype=np.float32),
    }


def _config() -> QueueConfig:
    return QueueConfig(tasks=(TaskSpec("c"),), capacity=Capacity(max_rows=None))


def _ops(n: int, scale: float) -> int:
    return max(5, int(scale * (300 if n == 1 else 30_000 // n if n <= 100 else 120)))


def bench_in_process(measure: Measure, scale: float) -> list[Result]:
    out: list[Result] = []
    for n in SIZES:
        cols = columns(n)
        qq: queue.Queue[Any] = queue.Queue()

        def qq_op(i: int, cols: Any = cols, qq: Any = qq) -> None:
            qq.put(cols)
            qq.get()

        q = TransferQueue(_config())
        reader = q.reader("c", ["obs", "act", "reward"], FixedSizeBatcher(n))
        key = [0]

        def relax_op(
            i: int, cols: Any = cols, n: int = n, q: Any = q, reader: Any = reader, key: list[int] = key
        ) -> None:
            base = key[0]
            key[0] += n
            q.put_columns(range(base, base + n), cols)
            reader.ack(reader.get_columns(timeout=0))

        ops = _ops(n, scale) * 20
        out.append(measure("queue.Queue, whole batch", f"numpy (n, d), {n} rows a call", qq_op, ops, n, ROW_BYTES))
        out.append(measure("relax in-process columns", f"numpy (n, d), {n} rows a call", relax_op, ops, n, ROW_BYTES))
    return out


def bench_ray_self_loop(ray: Any, measure: Measure, scale: float) -> list[Result]:
    from ray.util.queue import Queue as RayUtilQueue

    out: list[Result] = []
    rq = RayUtilQueue(actor_options={"num_cpus": 0})
    client = create_ray_queue("bench-arrays", _config())
    piped = create_ray_queue("bench-arrays-piped", _config(), pipeline_puts=True)
    try:
        # The unit of latency: one call to the queue actor that does nothing.
        out.append(measure("actor round trip", "no-op call", lambda i: client.version, _ops(1, scale), 1))
        for n in SIZES:
            cols = columns(n)

            def rq_op(i: int, cols: Any = cols) -> None:
                rq.put(cols)
                rq.get()

            ops = _ops(n, scale)
            workload = f"numpy (n, d), {n} rows a call, self loop"
            out.append(measure("ray.util.queue, whole batch", workload, rq_op, ops, n, ROW_BYTES))
            for label, c in (("relax Ray columns", client), ("relax Ray columns, pipelined puts", piped)):
                reader = c.reader("c", ["obs", "act", "reward"], FixedSizeBatcher(n))
                key, held = [n * 10**9], [None]  # one queue for every size: keys must not repeat

                def relax_op(
                    i: int,
                    cols: Any = cols,
                    n: int = n,
                    c: Any = c,
                    reader: Any = reader,
                    key: list[int] = key,
                    held: Any = held,
                ) -> None:
                    base = key[0]
                    key[0] += n
                    c.put_columns(range(base, base + n), cols)
                    held[0] = reader.get_columns(timeout=30, ack=held[0])

                calls = getattr(c, "round_trips", None)  # None: an older relax-queue measured side by side
                out.append(measure(label, workload, relax_op, ops, n, ROW_BYTES))
                if calls is not None:
                    out[-1]["calls_per_op"] = (c.round_trips - calls) / (ops + 1)  # measure() warms up once
                reader.ack(held[0])
    finally:
        client.shutdown()
        piped.shutdown()
        ray.kill(rq.actor)
    return out


def _actors(ray: Any) -> tuple[Any, Any]:
    @ray.remote(num_cpus=0)
    class Producer:
        """Puts ``ops`` batches of ``n`` rows (or groups of 8, for the trace)."""

        def __init__(self, name: str | None, rq: Any, pipelined: bool = False) -> None:
            self.client: RayQueueClient | None = connect(name, pipeline_puts=pipelined) if name else None
            self.rq = rq

        def run(self, ops: int, n: int, pid: int, grouped: bool) -> None:
            cols = columns(n, pid)
            for i in range(ops):
                if self.client is None:
                    self.rq.put(cols)
                    continue
                keys = [(pid, i, j) for j in range(n)]
                if grouped:
                    self.client.put_columns(keys, cols, group_ids=[(pid, i)] * n, group_sizes=n)
                else:
                    self.client.put_columns(keys, cols)
            if self.client is not None:
                self.client.flush()  # a pipelined producer's last put, applied before it reports done

    @ray.remote(num_cpus=0)
    class Consumer:
        """Takes ``rows`` rows, ``per_get`` at a time (relax) or items of ``n`` rows (ray.util.queue)."""

        def __init__(self, name: str | None, rq: Any) -> None:
            self.client: RayQueueClient | None = connect(name) if name else None
            self.rq = rq

        def run(self, rows: int, n: int, groups_per_get: int) -> int:
            seen = 0
            if self.client is None:
                while seen < rows:
                    items = [self.rq.get(timeout=120) for _ in range(groups_per_get)]
                    seen += sum(len(item["reward"]) for item in items)
                return seen
            batcher = GroupBatcher(groups_per_get) if groups_per_get > 1 else FixedSizeBatcher(n)
            reader = self.client.reader("c", ["obs", "act", "reward"], batcher)
            held = None
            while seen < rows:
                held = reader.get_columns(timeout=120, ack=held)
                seen += len(held)
            reader.ack(held)
            return seen

    return Producer, Consumer


def _pipeline(
    ray: Any,
    name: str | None,
    rq: Any,
    producers: int,
    ops: int,
    n: int,
    groups_per_get: int,
    pipelined: bool = False,
) -> float:
    """Wall seconds for ``producers`` actors to put ``ops`` batches of ``n`` rows each and one consumer
    actor to take them all."""
    producer_cls, consumer_cls = _actors(ray)
    makers = [producer_cls.remote(name, rq, pipelined) for _ in range(producers)]
    consumer = consumer_cls.remote(name, rq)
    ray.get([a.__ray_ready__.remote() for a in [*makers, consumer]])
    start = time.perf_counter()
    done = consumer.run.remote(producers * ops * n, n, groups_per_get)
    ray.get([a.run.remote(ops, n, pid, groups_per_get > 1) for pid, a in enumerate(makers)])
    ray.get(done)
    elapsed = time.perf_counter() - start
    for a in [*makers, consumer]:
        ray.kill(a)
    return elapsed


def bench_ray_actors(ray: Any, scale: float) -> list[Result]:
    """Producer actor -> consumer actor, and the GRPO-like trace (throughput only: rows/s)."""
    from ray.util.queue import Queue as RayUtilQueue

    out: list[Result] = []
    # Longer than the self loops: a pipeline of actors needs seconds to average out a loaded machine.
    cases = [(f"numpy (n, d), {n} rows a call, actor -> actor", 1, 3 * _ops(n, scale), n, 1) for n in (100, 1000)]
    trace_ops = max(20, int(300 * scale))
    cases.append((f"GRPO-like: {PRODUCERS} producers, groups of {GROUP}, 4 groups a get", PRODUCERS, trace_ops, 8, 4))
    for workload, producers, ops, n, per_get in cases:
        rows = producers * ops * n
        rq = RayUtilQueue(maxsize=0, actor_options={"num_cpus": 0})
        elapsed = _pipeline(ray, None, rq, producers, ops, n, per_get)
        ray.kill(rq.actor)
        out.append(_result("ray.util.queue, whole batch", workload, rows, elapsed))
        for label, pipelined in (("relax Ray columns", False), ("relax Ray columns, pipelined puts", True)):
            client = create_ray_queue("bench-actors", _config())
            try:
                elapsed = _pipeline(ray, "bench-actors", None, producers, ops, n, per_get, pipelined)
            finally:
                client.shutdown()
            out.append(_result(label, workload, rows, elapsed))
    return out


def _result(name: str, workload: str, rows: int, elapsed: float) -> Result:
    return {
        "transport": name,
        "workload": workload,
        "rows_per_s": rows / elapsed,
        "p50_ms": float("nan"),
        "p99_ms": float("nan"),
        "gb_per_s": rows * ROW_BYTES / elapsed / 1e9,
    }
