"""Writes the listen example's rows: ``train.jsonl`` and ``eval.jsonl`` under ``--out`` (see ``listen_env.py``).

Each row: ``prompt`` (the segment named), ``answer`` (its pitch's code), ``extra_info`` (the clip's seed, the segment,
and the answer options 1-4, which give the summary its chance level and the format warm-up its targets),
``data_source`` ``listen``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def rows(n: int, seed: int) -> list[dict[str, object]]:
    """``n`` rows of a random segment and pitch each, drawn with ``seed``."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        pitch = rng.choice("1234")
        segment = rng.randint(1, 4)
        out.append(
            {
                "prompt": f"listen {segment}",
                "answer": pitch,
                "extra_info": {
                    "seed": seed * 1_000_003 + i,
                    "segment": segment,
                    "options": ["1", "2", "3", "4"],
                },
                "data_source": "listen",
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="folder for train.jsonl and eval.jsonl")
    parser.add_argument("--train", type=int, default=512)
    parser.add_argument("--eval", type=int, default=32)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, n, seed in (("train", args.train, 0), ("eval", args.eval, 1)):
        path = args.out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows(n, seed)), encoding="utf-8")
        print(f"wrote {n} rows to {path}")


if __name__ == "__main__":
    main()
