"""Run by test_realise.py as one gloo rank: build each plan's DeviceMesh and record every group's members.

Usage: python _gloo_worker.py RANK WORLD_SIZE OUT_DIR 'JSON list of ParallelConfig kwargs'
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from relax_parallel import EXPERT_MESH_DIMS, MESH_DIMS, ParallelConfig, ParallelPlan


def _record(mesh: object, names: tuple[str, ...]) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for name in names:
        group = mesh.get_group(name)  # type: ignore[attr-defined]
        ranks = dist.get_process_group_ranks(group)
        # The group must carry traffic, not only exist: its all-reduce of global ranks sums its members.
        value = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(value, group=group)
        out[name] = {"ranks": sorted(ranks), "sum": int(value.item())}
    return out


def _worker(rank: int, world: int, out_dir: str, configs: list[dict[str, int]]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world)
    try:
        results = []
        for kwargs in configs:
            plan = ParallelPlan.from_config(ParallelConfig(**kwargs))
            entry = {"dense": _record(plan.device_mesh("cpu"), MESH_DIMS)}
            if plan.ep > 1:
                entry["expert"] = _record(plan.expert_device_mesh("cpu"), EXPERT_MESH_DIMS)
            results.append(entry)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]))
