"""Sharded checkpoints of :class:`~relax_services.engines.fsdp.train.FSDPTrainEngine` with
``torch.distributed.checkpoint`` (DCP), and export of the full weights.

A checkpoint folder holds the DCP files of the model and optimizer shards (keyed by parameter name, so a
checkpoint saved on ``N`` ranks loads on ``M``: DCP reshards), ``engine_meta.pt`` (scheduler, version, world
size) and ``rng_rank{R}.pt`` per rank. A LoRA engine's (``config.lora``) model entries are its adapters alone: the
frozen weights are the model folder's. It is written into a temporary sibling folder and renamed into place
by rank 0 after every rank has finished, like the run checkpoints of the run checkpoints
(:class:`~relax_services.control.checkpoint.CheckpointManager`): a
crash mid-write leaves the previous checkpoint intact and never a half-written one under the final name.

Every function here except :func:`checkpoint_model_state` is collective over the engine's shard group (every
rank holding a piece of the model: the data-parallel ranks, times the tensor-parallel ones under tensor
parallelism), and "rank" below means a rank of that group.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from relax_services._files import fsync_path
from relax_services.engines.fsdp.state import load_train_state
from relax_services.engines.fsdp.train import FSDPTrainEngine
from relax_services.models.lora import ADAPTER_FOLDER, adapter_names, save_adapter

__all__ = ["META_FILE", "checkpoint_model_state", "export_hf", "load_checkpoint", "save_checkpoint"]

META_FILE = "engine_meta.pt"
_MODEL_KEY = "model"
_OPTIMIZER_KEY = "optimizer"
# strict=False: parameters that have never had a gradient have no optimizer state to load (the model's own
# entries are all there; DCP's load already fails on a missing weight).
_NO_STATE_FOR_UNUSED = StateDictOptions(strict=False)


def _rng_file(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def _rank0_replace(engine: FSDPTrainEngine, tmp: Path, final: Path) -> None:
    """After every rank wrote into ``tmp``: rank 0 flushes it and renames it to ``final`` (replacing an older
    one); every rank returns once the rename is done."""
    dist.barrier(group=engine.shard_group)
    if engine.shard_rank == 0:
        for f in tmp.rglob("*"):
            if f.is_file():
                fsync_path(f)
        fsync_path(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_path(final.parent)
    dist.barrier(group=engine.shard_group)


def _fresh_tmp(engine: FSDPTrainEngine, final: Path) -> Path:
    tmp = final.with_name(f".tmp-{final.name}")
    if engine.shard_rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier(group=engine.shard_group)
    return tmp


def save_checkpoint(engine: FSDPTrainEngine, folder: Path) -> Path:
    """Writes the engine's sharded state to ``folder`` atomically (collective; the folder must be on a file
    system every rank sees).

    Returns:
        ``folder``.
    """
    folder = Path(folder)
    tmp = _fresh_tmp(engine, folder)
    model_state, optim_state = engine.train_state()  # no moments before the first update; LoRA: adapters only
    state = {_MODEL_KEY: model_state, _OPTIMIZER_KEY: optim_state}
    dcp_save(state, checkpoint_id=tmp, process_group=engine.shard_group)
    rng: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, tmp / _rng_file(engine.shard_rank))
    if engine.shard_rank == 0:
        ranks = dist.get_world_size(engine.shard_group)
        meta = {"scheduler": engine.scheduler.state_dict(), "version": engine.version, "world_size": ranks}
        torch.save(meta, tmp / META_FILE)
    _rank0_replace(engine, tmp, folder)
    return folder


def load_checkpoint(engine: FSDPTrainEngine, folder: Path) -> None:
    """Restores a checkpoint saved on any number of ranks into ``engine`` (collective).

    Model and optimizer shards are resharded to the engine's mesh. Rank ``R`` takes the RNG state that rank
    ``R mod N`` saved (``N`` the saving world size).

    Raises:
        FileNotFoundError: If ``folder`` holds no complete checkpoint.
    """
    folder = Path(folder)
    if not (folder / META_FILE).is_file():
        raise FileNotFoundError(f"{folder} is not an FSDP engine checkpoint (no {META_FILE})")
    meta = torch.load(folder / META_FILE, map_location="cpu", weights_only=False)
    # The templates fix the target sharding; get_state_dict also creates the optimizer's state tensors when
    # it has not stepped yet, so that the moments have somewhere to load into.
    model_state, optim_state = get_state_dict(engine.model, engine.optimizer)
    if engine.config.lora is not None:  # the checkpoint holds the adapters; the frozen weights stay the model's
        adapters = set(adapter_names(engine.model))
        model_state = {name: value for name, value in model_state.items() if name in adapters}
    # ... but a parameter that never had a gradient before the save has no optimizer state in the checkpoint,
    # and must have none after the load (AdamW's first step on it must be its step 1).
    saved = FileSystemReader(folder).read_metadata().state_dict_metadata
    moments: dict[str, dict[str, Any]] = cast(dict[str, dict[str, Any]], optim_state["state"])
    optim_state["state"] = {
        fqn: entry
        for fqn, entry in moments.items()
        if all(f"{_OPTIMIZER_KEY}.state.{fqn}.{name}" in saved for name in entry)
    }
    state: dict[str, Any] = {_MODEL_KEY: model_state, _OPTIMIZER_KEY: optim_state}
    dcp_load(state, checkpoint_id=folder, process_group=engine.shard_group)
    load_train_state(engine.model, engine.optimizer, state[_MODEL_KEY], state[_OPTIMIZER_KEY], _NO_STATE_FOR_UNUSED)
    engine.scheduler.load_state_dict(meta["scheduler"])
    rng_file = folder / _rng_file(engine.shard_rank % int(meta["world_size"]))
    rng = torch.load(rng_file, map_location="cpu", weights_only=False)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    engine._version = int(meta["version"])


def checkpoint_model_state(folder: Path) -> dict[str, torch.Tensor]:
    """The full model weights of a checkpoint folder (of a LoRA engine: its adapters), read in this process alone
    (no process group needed).

    Raises:
        FileNotFoundError: If ``folder`` holds no complete checkpoint.
    """
    folder = Path(folder)
    if not (folder / META_FILE).is_file():
        raise FileNotFoundError(f"{folder} is not an FSDP engine checkpoint (no {META_FILE})")
    metadata = FileSystemReader(folder).read_metadata()
    prefix = f"{_MODEL_KEY}."
    template = {
        key[len(prefix) :]: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
    }
    state: dict[str, Any] = {_MODEL_KEY: template}
    with warnings.catch_warnings():  # DCP warns that it loads in one process, which is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp_load(state, checkpoint_id=folder, no_dist=True)
    loaded: dict[str, torch.Tensor] = state[_MODEL_KEY]
    return loaded


def export_hf(engine: FSDPTrainEngine, folder: Path, side_files_from: Path | None = None) -> Path:
    """Gathers the full weights from the shards and writes them as a transformers checkpoint (``config.json``
    and ``model.safetensors``) atomically from rank 0 (collective: every rank takes part in the gathers). With
    ``model.lora`` (``engine.config.lora``), as :func:`~relax_services.models.export.export_checkpoint` writes a LoRA
    run's: the merged model, and the adapters in peft's format in its ``adapter`` folder (the base recorded as
    ``side_files_from``, or ``folder`` itself without it).

    Args:
        engine: The sharded engine.
        folder: The checkpoint folder to write.
        side_files_from: The checkpoint folder the model came from: its tokenizer, chat template and processor
            files are copied beside the weights, so :func:`~relax_services.models.load_model` reads the result.

    Returns:
        ``folder``.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    full = engine.policy_state()
    lora = engine.config.lora
    adapters = engine.adapter_state() if lora is not None else {}
    tmp = _fresh_tmp(engine, folder)
    if engine.shard_rank == 0:
        engine.model.config.save_pretrained(tmp)  # type: ignore[union-attr,operator]
        generation = getattr(engine.model, "generation_config", None)  # a critic has none
        if generation is not None:
            generation.save_pretrained(tmp)
        save_file(
            {k: v.contiguous() for k, v in full.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"}
        )
        if side_files_from is not None:
            from relax_services.models import copy_side_files

            copy_side_files(side_files_from, tmp)
        if lora is not None:
            base = side_files_from if side_files_from is not None else folder
            save_adapter(engine.model, lora, tmp / ADAPTER_FOLDER, base, state=adapters)
    _rank0_replace(engine, tmp, folder)
    return folder
