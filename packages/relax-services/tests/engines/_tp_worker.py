"""Run by test_engines_tp.py as one gloo rank of a 4-process group: tensor parallelism with data parallelism
(a 2 × 2 mesh) and sharded checkpoints of a tensor-parallel engine resumed on other layouts. Saves what each
rank saw to ``OUT_DIR/rank{R}.pt``.

The checkpoint scenarios need groups of 2 and 1 ranks. A mesh over part of the world would leave the other
ranks out of the collectives that build it, so every layout here is a mesh over all four ranks with a leading
``replica`` dimension: each replica is an independent engine on its own ranks (the 2-rank layouts run twice
side by side, the 1-rank layout four times), every replica training the same batches.

Batches, config and loss come from ``_fsdp_worker.py``, so the test builds its single-process reference from
the same definitions.

Usage: python _tp_worker.py RANK WORLD_SIZE OUT_DIR
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _fsdp_worker import CONFIG, UPDATES, _full, _train, batch
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from relax_parallel import ParallelConfig, ParallelPlan
from relax_services.engines.fsdp.checkpoint import export_hf, load_checkpoint, save_checkpoint
from relax_services.engines.fsdp.state import clone_state, load_train_state, train_state
from relax_services.engines.fsdp.train import FSDPTrainEngine
from relax_services.models import build_tiny_omni
from relax_services.models.tiny_omni import tiny_omni_checkpoint

WORLD = 4
SAVED_AFTER = 2  # updates before the checkpoint; two more after it
FULL = StateDictOptions(full_state_dict=True)  # every rank gets the full tensors (cpu_offload: rank 0 only)


def _engine(replicas: int, dp: int, tp: int, seed: int = 0) -> tuple[FSDPTrainEngine, int]:
    """An engine on a ``(replica, dp, tp)`` mesh over the four ranks, and this rank's replica index."""
    mesh = init_device_mesh("cpu", (replicas, dp, tp), mesh_dim_names=("replica", "dp", "tp"))
    engine = FSDPTrainEngine(build_tiny_omni(seed), CONFIG, mesh=mesh["dp"], tp_mesh=mesh["tp"])
    return engine, mesh.get_local_rank("replica")


def tp_dp(out: dict[str, Any]) -> None:
    """dp = 2 × tp = 2, the mesh the Trainer group builds from its plan (``ParallelPlan.device_mesh``)."""
    mesh: DeviceMesh = ParallelPlan.from_config(ParallelConfig(dp=2, tp=2)).device_mesh("cpu")
    engine = FSDPTrainEngine(build_tiny_omni(0), CONFIG, mesh=mesh["dp"], tp_mesh=mesh["tp"])
    out["tp_dp_coords"] = (mesh.get_local_rank("dp"), mesh.get_local_rank("tp"))
    out["tp_dp_metrics"] = _train(engine, range(UPDATES))
    out["tp_dp_weights"] = engine.policy_state()
    out["tp_dp_logprobs"] = engine.compute_logprobs(batch(100))


def _record_state(out: dict[str, Any], key: str, engine: FSDPTrainEngine) -> None:
    """The full model and optimizer state (gathered on every rank), as the checkpoint holds it."""
    model, optimizer = train_state(engine.model, engine.optimizer, FULL)
    out[f"{key}_model"] = _full(model)
    out[f"{key}_optimizer"] = _full(optimizer)
    out[f"{key}_version"] = engine.version
    out[f"{key}_lr"] = float(engine.optimizer.param_groups[0]["lr"])


def _resume(out: dict[str, Any], key: str, folder: Path, replicas: int, dp: int, tp: int) -> None:
    """A fresh engine (other initial weights: all of them must be loaded) resumes from the checkpoint that the
    tp = 2 replica on its ranks saved (ranks 0, 1 saved ``ckpt0``, ranks 2, 3 ``ckpt1``), then trains the two
    updates after it."""
    engine, _ = _engine(replicas, dp, tp, seed=5)
    load_checkpoint(engine, folder / f"ckpt{dist.get_rank() // 2}")
    _record_state(out, key, engine)
    out[f"{key}_metrics"] = _train(engine, range(SAVED_AFTER, SAVED_AFTER + 2))
    out[f"{key}_weights"] = engine.policy_state()


def checkpoints(out: dict[str, Any], folder: Path) -> None:
    """Save at (world 2, tp 2); resume at (world 2, tp 2), (world 2, tp 1) and (world 1)."""
    engine, replica = _engine(2, 1, 2)
    _train(engine, range(SAVED_AFTER))
    save_checkpoint(engine, folder / f"ckpt{replica}")
    export_hf(engine, folder / f"hf{replica}", side_files_from=tiny_omni_checkpoint(0))
    _record_state(out, "saved", engine)
    out["saved_weights"] = engine.policy_state()
    # The full state (what the Trainer group's run checkpoints hold), copied: over a 1-rank dp mesh the full
    # tensor of an unsplit weight is the live shard itself.
    model, optimizer = (clone_state(part) for part in train_state(engine.model, engine.optimizer, FULL))
    scheduler = engine.scheduler.state_dict()
    out["continued_metrics"] = _train(engine, range(SAVED_AFTER, SAVED_AFTER + 2))
    out["continued_weights"] = engine.policy_state()

    _resume(out, "tp2", folder, 2, 1, 2)
    _resume(out, "dp2", folder, 2, 2, 1)
    _resume(out, "solo", folder, 4, 1, 1)

    # A tensor-parallel engine loads the full state as the Trainer group's load_state_dict does.
    full, _ = _engine(2, 1, 2, seed=5)
    load_train_state(full.model, full.optimizer, model, optimizer, StateDictOptions(full_state_dict=True, strict=False))
    full.scheduler.load_state_dict(scheduler)
    full._version = SAVED_AFTER
    _record_state(out, "full", full)
    out["full_metrics"] = _train(full, range(SAVED_AFTER, SAVED_AFTER + 2))
    out["full_weights"] = full.policy_state()


def main(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world)
    try:
        out: dict[str, Any] = {}
        t0 = time.perf_counter()
        tp_dp(out)
        t1 = time.perf_counter()
        checkpoints(out, Path(out_dir))
        out["phase_s"] = {"tp_dp": t1 - t0, "checkpoints": time.perf_counter() - t1}
        torch.save(out, Path(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
