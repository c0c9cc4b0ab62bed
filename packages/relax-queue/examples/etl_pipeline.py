"""A non-RL use of relax_queue: a three-stage document pipeline, no ML dependency.

A crawler thread puts raw documents (bytes) into a bounded queue. Three consumer groups share it:

- ``extract`` reads ``raw`` and adds a ``words`` field to the same row (a later stage's input);
- ``index`` needs ``words`` and builds an inverted index (word -> document keys);
- ``archive`` needs ``raw`` and stores a zlib-compressed copy.

A row is freed once all three groups acked it; the crawler blocks while the queue is full
(backpressure), and a flaky archiver that nacks some batches shows redelivery. Run it with
``python packages/relax-queue/examples/etl_pipeline.py``.
"""

from __future__ import annotations

import random
import threading
import zlib
from collections import defaultdict
from typing import Any

from relax_queue import (
    Capacity,
    FixedSizeBatcher,
    QueueConfig,
    QueueTimeoutError,
    RowInput,
    TaskSpec,
    TransferQueue,
)

VOCAB = ["queue", "video", "frame", "audio", "codec", "index", "batch", "stream", "lease", "group"]


def make_documents(n_docs: int, seed: int) -> dict[str, bytes]:
    """``n_docs`` random documents of 5-40 words from a small vocabulary."""
    rng = random.Random(seed)
    return {f"doc{i:04d}": " ".join(rng.choices(VOCAB, k=rng.randint(5, 40))).encode() for i in range(n_docs)}


def run_pipeline(docs: dict[str, bytes], max_rows: int = 16, seed: int = 0) -> dict[str, Any]:
    """Push ``docs`` through the queue; returns the index, the archive and the queue metrics."""
    queue = TransferQueue(
        QueueConfig(
            tasks=(TaskSpec("extract"), TaskSpec("index"), TaskSpec("archive")),
            capacity=Capacity(max_rows=max_rows, max_bytes=64 * 1024),
            lease_timeout_s=5.0,
        )
    )
    index: dict[str, set[str]] = defaultdict(set)
    archive: dict[str, bytes] = {}
    producer_done = threading.Event()

    def crawler() -> None:
        items = list(docs.items())
        for start in range(0, len(items), 8):
            rows = [RowInput(key, {"raw": raw}, tags={"nbytes": len(raw)}) for key, raw in items[start : start + 8]]
            queue.put_many(rows, timeout=30)  # blocks while the queue is full
        producer_done.set()

    def stage(task: str, fields: list[str], work: Any) -> None:
        reader = queue.reader(task, fields, FixedSizeBatcher(size=4, partial=True))
        while True:
            try:
                batch = reader.get(timeout=0.2)
            except QueueTimeoutError:
                if producer_done.is_set() and queue.metrics()["tasks"][task]["backlog"] == 0:
                    return
                continue
            if work(batch) is False:
                reader.nack(batch)
            else:
                reader.ack(batch)

    def extract(batch: Any) -> None:
        queue.add_fields_many({row.key: {"words": row.fields["raw"].decode().split()} for row in batch})

    def build_index(batch: Any) -> None:
        for row in batch:
            for word in row.fields["words"]:
                index[word].add(row.key)

    flaky = random.Random(seed)

    def store(batch: Any) -> bool:
        if flaky.random() < 0.2:  # a transient failure: give the batch back
            return False
        for row in batch:
            archive[row.key] = zlib.compress(row.fields["raw"])
        return True

    threads = [
        threading.Thread(target=crawler),
        threading.Thread(target=stage, args=("extract", ["raw"], extract)),
        threading.Thread(target=stage, args=("index", ["words"], build_index)),
        threading.Thread(target=stage, args=("archive", ["raw"], store)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return {"index": dict(index), "archive": archive, "metrics": queue.metrics()}


def main() -> None:
    """Run the pipeline on 200 documents and print a summary."""
    docs = make_documents(200, seed=0)
    result = run_pipeline(docs)
    m = result["metrics"]
    print(f"documents: {len(docs)}  archived: {len(result['archive'])}  indexed words: {len(result['index'])}")
    print(f"queue depth now: {m['depth_rows']} rows; producer waits for capacity: {m['put_waits']}")
    print(f"redeliveries after nack: {m['redeliveries']}; rows freed: {m['freed']}")


if __name__ == "__main__":
    main()
