"""Streaming bound of the dataset reader: memory while reading a large verl-schema parquet stays flat.

Writes a parquet of ``--rows`` rows (default 200,000) in verl's RL schema, each with an inline image of
``--payload`` random bytes (not decoded: the reader's job is rows, not pixels), then reads it in a fresh
child process twice:

- ``stream``: ``build_stream`` (record batches of 256 rows, shuffle buffer 1,024, full row parsing),
  printing the process RSS and Arrow's allocated bytes every 10 % of the rows;
- ``whole``: ``pyarrow.parquet.read_table`` of the file, the reference that holds it all.

Run: ``uv run --no-sync python packages/relax-modalities/benchmarks/bench_dataset_stream.py``
(``--rows``, ``--payload``, ``--row-group`` to change the file). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def rss_mib() -> float:
    """Resident set size of this process now (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def write(path: Path, rows: int, payload: int, row_group: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = None
    with_images = []
    writer = None
    chunk = 10_000
    for start in range(0, rows, chunk):
        with_images = [
            {
                "data_source": "bench",
                "prompt": [{"role": "user", "content": f"<image>Question {i}?"}],
                "images": [{"bytes": os.urandom(payload), "path": None}],
                "reward_model": {"style": "rule", "ground_truth": str(i)},
                "extra_info": {"index": i},
            }
            for i in range(start, min(rows, start + chunk))
        ]
        table = pa.Table.from_pylist(with_images, schema=schema)
        schema = table.schema
        if writer is None:
            writer = pq.ParquetWriter(path, schema)
        writer.write_table(table, row_group_size=row_group)
    assert writer is not None
    writer.close()


def read_stream(path: Path) -> dict[str, object]:
    import pyarrow as pa

    from relax_modalities import build_stream

    start_rss = rss_mib()
    stream = build_stream([path], shuffle_buffer=1024, seed=0)
    total = len(stream.sources[0])
    marks: list[tuple[int, float, float]] = []
    t0 = time.perf_counter()
    n = 0
    for n, _ in enumerate(stream, 1):
        if n % (total // 10) == 0:
            marks.append((n, rss_mib(), pa.total_allocated_bytes() / 2**20))
    return {"rows": n, "start_rss": start_rss, "marks": marks, "seconds": time.perf_counter() - t0}


def read_whole(path: Path) -> dict[str, object]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    start_rss = rss_mib()
    t0 = time.perf_counter()
    table = pq.read_table(path)
    return {
        "rows": table.num_rows,
        "start_rss": start_rss,
        "marks": [(table.num_rows, rss_mib(), pa.total_allocated_bytes() / 2**20)],
        "seconds": time.perf_counter() - t0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--payload", type=int, default=1024, help="bytes of inline image per row")
    parser.add_argument("--row-group", type=int, default=20_000)
    parser.add_argument("--child", choices=["stream", "whole"], help=argparse.SUPPRESS)
    parser.add_argument("--file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps((read_stream if args.child == "stream" else read_whole)(args.file)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.parquet"
        write(path, args.rows, args.payload, args.row_group)
        size = path.stat().st_size / 2**20
        print(
            f"{args.rows} rows, {args.payload} B inline image each, "
            f"row groups of {args.row_group}: {size:.0f} MiB file\n"
        )
        results = {}
        for mode in ("stream", "whole"):
            cmd = [sys.executable, __file__, "--child", mode, "--file", str(path)]
            results[mode] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    stream, whole = results["stream"], results["whole"]
    print("| reader | rows read | RSS MiB (after import → at each 10 % of rows) | Arrow MiB at end | seconds |")
    print("| --- | --- | --- | --- | --- |")
    marks = stream["marks"]
    series = " ".join(f"{m[1]:.0f}" for m in marks)
    print(
        f"| build_stream | {stream['rows']} | {stream['start_rss']:.0f} → {series} "
        f"| {marks[-1][2]:.1f} | {stream['seconds']:.1f} |"
    )
    w = whole["marks"][0]
    print(
        f"| pq.read_table | {whole['rows']} | {whole['start_rss']:.0f} → {w[1]:.0f} "
        f"| {w[2]:.1f} | {whole['seconds']:.1f} |"
    )
    first, last = marks[0][1], marks[-1][1]
    print(
        f"\nstream RSS growth from 10 % to 100 % of the rows: {last - first:+.1f} MiB; "
        f"whole-file read holds {w[1] - whole['start_rss']:.0f} MiB"
    )


if __name__ == "__main__":
    main()
