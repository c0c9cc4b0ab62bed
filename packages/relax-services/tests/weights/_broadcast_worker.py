"""Run by test_weight_broadcast.py as one rollout worker of a broadcast weight-sync group: receives versions
from the test's sender and saves each one it receives whole to ``OUT_DIR/slot{S}_v{V}.pt``.

Only torch is imported (no model stack), so a worker starts in seconds.

Usage: python _broadcast_worker.py ADDRESS SLOT RECEIVERS OUT_DIR UNTIL SINK
    SINK: ``state`` (a StateDictSink) or ``loader`` (a BucketLoader into a model of the same architecture).
    The worker stops after version UNTIL, or once ``OUT_DIR/stop`` exists.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from relax_services.weights.broadcast import BroadcastConfig, BroadcastWeightReceiver, StateDictSink
from relax_services.weights.buckets import BucketLoader

TIMEOUT_S = 10.0
JOIN_WINDOW_S = 15.0  # longer than a broadcast's timeout: a survivor stuck in a broken one answers in time


def config(receivers: int) -> BroadcastConfig:
    """The group settings every side of the test uses (``RELAX_SYNC_BACKEND=nccl``: the GPU variant)."""
    backend = "nccl" if os.environ.get("RELAX_SYNC_BACKEND") == "nccl" else "gloo"
    return BroadcastConfig(receivers=receivers, backend=backend, timeout_s=TIMEOUT_S, join_window_s=JOIN_WINDOW_S)


class Policy(torch.nn.Module):
    """Weights of three dtypes and a buffer, each tensor larger than 64 bytes."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Parameter(torch.randn(16, 8, generator=gen))
        self.proj = torch.nn.Parameter(torch.randn(8, 8, generator=gen).to(torch.bfloat16))
        self.head = torch.nn.Parameter(torch.randn(8, 16, generator=gen, dtype=torch.float64))
        self.register_buffer("positions", torch.arange(40, dtype=torch.int64))


def main() -> None:
    address, slot, receivers, out, until, sink_kind = sys.argv[1:]
    out_dir = Path(out)
    receiver = BroadcastWeightReceiver(address, int(slot), config(int(receivers)))
    model = Policy(seed=99)  # weights unlike the sender's: only received values can make them equal
    sink = StateDictSink() if sink_kind == "state" else BucketLoader(model)
    while not (out_dir / "stop").exists():
        stats = receiver.receive(sink, timeout_s=1.0)
        if stats is None:
            continue
        state = sink.state_dict if isinstance(sink, StateDictSink) else model.state_dict()
        path = out_dir / f"slot{slot}_v{stats.version}.pt"
        torch.save({k: v.clone() for k, v in state.items()}, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)  # whole files only: the test polls for them
        if stats.version >= int(until):
            return


if __name__ == "__main__":
    main()
