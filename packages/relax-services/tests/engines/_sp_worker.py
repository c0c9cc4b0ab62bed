"""Run by test_engines_sp.py as one gloo rank: sequence parallelism of the FSDP2 engine. With 2 ranks, sp = 2
(dp = 1); with 4 ranks, dp = 2 × sp = 2 and sp = 2 × tp = 2, and an sp checkpoint resumed on other layouts. Saves
what each rank saw to ``OUT_DIR/rank{R}.pt``: gradients of one minibatch, metrics and weights after updates, log-probs
of a held-out batch, and what the rank ran locally (the decoder's input shapes, the LM head's rows, the all-to-all
calls).

Batches, config and loss come from ``_fsdp_worker.py``, so the test builds its single-process reference from the
same definitions.

Usage: python _sp_worker.py RANK WORLD_SIZE OUT_DIR
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _fsdp_worker import CONFIG, _full, batch, pg_token_mean

from relax_parallel import ParallelConfig, ParallelPlan
from relax_services.engines.fsdp.train import FSDPConfig, FSDPTrainEngine
from relax_services.models import build_tiny_omni

UPDATES = 2
HELD_OUT = 100  # batch(HELD_OUT) is scored after the updates


def grad_batch() -> list[Any]:
    """Two images, two audio clips, one video of two temporal patches and a text prompt (other seeds give other
    media): the gradient probe's one micro-batch, in which the ranks of an sp group share the encoding of each
    modality's items, the video's along time."""
    return [batch(0)[0], batch(1)[0], batch(0)[2], batch(1)[2], batch(0)[5], batch(0)[1]]


def _engine(layout: ParallelConfig, fsdp: FSDPConfig | None = None) -> tuple[FSDPTrainEngine, dict[str, int]]:
    mesh = ParallelPlan.from_config(layout).device_mesh("cpu")
    tp_mesh = mesh["tp"] if layout.tp > 1 else None
    engine = FSDPTrainEngine(build_tiny_omni(0), CONFIG, fsdp, mesh=mesh["dp"], tp_mesh=tp_mesh, sp_mesh=mesh["cp"])
    coords = {d: mesh.get_local_rank(d) for d in ("dp", "cp", "tp")}
    return engine, coords


def _probe(engine: FSDPTrainEngine, out: dict[str, Any], key: str) -> None:
    """Scores the held-out batch, recording the decoder's input shapes, the LM head's rows and the exchanges."""
    shapes: list[tuple[int, ...]] = []
    rows: list[int] = []
    block = engine.model.get_submodule("model.layers.0")
    hooks = [
        block.register_forward_pre_hook(lambda m, args, kwargs: shapes.append(tuple(args[0].shape)), with_kwargs=True),
        engine.model.get_submodule("lm_head").register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[0])),
    ]
    sp = engine.sequence_parallel
    before = (sp.exchanges, sp.local_tokens) if sp is not None else (0, 0)
    out[f"{key}_logprobs"] = engine.compute_logprobs(batch(HELD_OUT))
    for h in hooks:
        h.remove()
    out[f"{key}_block_inputs"] = shapes
    out[f"{key}_head_rows"] = sum(rows)
    if sp is not None:
        out[f"{key}_exchanges"] = sp.exchanges - before[0]
        out[f"{key}_local_tokens"] = sp.local_tokens - before[1]


def _gradients(engine: FSDPTrainEngine, out: dict[str, Any], key: str) -> None:
    """Full gradients of the loss over :func:`grad_batch` as one micro-batch per rank's share, before clipping, and
    the media items this rank encoded for it."""
    engine.optimizer.zero_grad(set_to_none=True)
    engine._used.zero_()
    sp = engine.sequence_parallel
    assert sp is not None
    before, frames = sp.encoded_items, sp.encoded_frames
    engine.config = dataclasses.replace(CONFIG, micro_batch_size=len(grad_batch()))
    engine._accumulate_gradients(grad_batch(), pg_token_mean)
    engine.config = CONFIG
    engine._drop_unused_gradients()
    out[f"{key}_grads"] = {n: _full(p.grad) for n, p in engine.model.named_parameters() if p.grad is not None}
    out[f"{key}_encoded_items"] = sp.encoded_items - before
    out[f"{key}_encoded_frames"] = sp.encoded_frames - frames
    engine.optimizer.zero_grad(set_to_none=True)


def scenario(out: dict[str, Any], key: str, layout: ParallelConfig) -> None:
    engine, coords = _engine(layout)
    out[f"{key}_coords"] = coords
    _gradients(engine, out, key)
    out[f"{key}_metrics"] = [engine.step(batch(s), pg_token_mean) for s in range(UPDATES)]
    out[f"{key}_weights"] = engine.policy_state()
    _probe(engine, out, key)


def resume_elsewhere(out: dict[str, Any], folder: Path) -> None:
    """A checkpoint saved at dp = 2 × sp = 2 after the updates, restored at dp = 4 (every rank its own share) and
    back at dp = 2 × sp = 2. Records the full model and optimizer state before the save and after each load, and
    one more update from each."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from relax_services.engines.fsdp.checkpoint import load_checkpoint, save_checkpoint
    from relax_services.engines.fsdp.state import train_state

    full = StateDictOptions(full_state_dict=True)
    engine, _ = _engine(ParallelConfig(dp=2, cp=2))
    for s in range(UPDATES):
        engine.step(batch(s), pg_token_mean)
    save_checkpoint(engine, folder / "ckpt")
    out["saved_state"] = [_full(part) for part in train_state(engine.model, engine.optimizer, full)]
    out["continued"] = engine.step(batch(UPDATES), pg_token_mean)
    for key, layout in (("dp4", ParallelConfig(dp=4)), ("dp2sp2", ParallelConfig(dp=2, cp=2))):
        other, _ = _engine(layout)
        load_checkpoint(other, folder / "ckpt")
        out[f"{key}_loaded_state"] = [_full(part) for part in train_state(other.model, other.optimizer, full)]
        out[f"{key}_loaded_version"] = other.version
        out[f"{key}_continued"] = other.step(batch(UPDATES), pg_token_mean)


def main(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world)
    try:
        out: dict[str, Any] = {"phase_s": {}}
        layouts = (
            {"sp2": ParallelConfig(cp=2)}
            if world == 2
            else {
                "dp2sp2": ParallelConfig(dp=2, cp=2),
                "sp2tp2": ParallelConfig(cp=2, tp=2),
            }
        )
        for key, layout in layouts.items():
            start = time.perf_counter()
            scenario(out, key, layout)
            out["phase_s"][key] = time.perf_counter() - start
        if world == 2:  # the same gradients with every block recomputed in the backward (collectives and all)
            _gradients(_engine(ParallelConfig(cp=2), FSDPConfig(activation_checkpointing=True))[0], out, "sp2ckpt")
        if world == 4:
            start = time.perf_counter()
            resume_elsewhere(out, Path(out_dir))
            out["phase_s"]["resume"] = time.perf_counter() - start
        torch.save(out, Path(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
