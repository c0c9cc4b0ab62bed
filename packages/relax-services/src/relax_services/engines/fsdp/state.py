"""State dicts of the FSDP2 engine: ``torch.distributed.checkpoint.state_dict`` without its side effect on a fresh
optimizer, and deep copies of sharded state.

:func:`train_state` / :func:`load_train_state` give and take the model and optimizer entries keyed by parameter
name, as DTensors on the engine's meshes (sharded, what ``torch.distributed.checkpoint`` saves and reshards) or,
with ``StateDictOptions(full_state_dict=True)``, as full tensors. Used by the engine's ``state_dict``, by
:mod:`~relax_services.engines.fsdp.checkpoint` and by the Trainer group's full-state checkpoints.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch
from torch.distributed.checkpoint.state_dict import (
    OptimizerStateType,
    StateDictOptions,
    ValueType,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

__all__ = ["clone_state", "load_train_state", "train_state", "trainable_state"]


def train_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    options: StateDictOptions | None = None,
    *,
    trainable_only: bool = False,
) -> tuple[dict[str, ValueType], OptimizerStateType]:
    """``get_state_dict(model, optimizer)`` without its side effect on an optimizer that has not stepped yet.

    ``trainable_only``: the model entries of the parameters that train only (``model.lora``'s adapters: the frozen
    weights are the checkpoint folder's), never gathering the others; :func:`load_train_state` takes such a partial
    state with ``strict=False``.

    ``get_state_dict`` creates a fresh optimizer's state by stepping it once at lr 0 with zero gradients: the
    weights stay, but AdamW's step count becomes 1, so the first real update would use the bias correction of
    step 2 and differ from one process's (measured: 2.6e-4 on the weights after one update at lr 1e-3). Here that
    state is dropped again, from the optimizer and from the returned dict: a checkpoint taken before the first
    update (a run's step-0 checkpoint) holds no moments, as the single-process engine's does.
    """
    fresh = not optimizer.state
    if trainable_only:
        model_state = trainable_state(model, options or StateDictOptions())
        optim_state = get_optimizer_state_dict(model, optimizer, options=options)
    else:
        model_state, optim_state = get_state_dict(model, optimizer, options=options)
    if fresh:
        optimizer.state.clear()
        optim_state = {**optim_state, "state": {}}
    return model_state, optim_state


def trainable_state(model: torch.nn.Module, options: StateDictOptions) -> dict[str, ValueType]:
    """The trainable parameters by name: as DTensors (sharded), or with ``options.full_state_dict`` gathered (a
    collective over each one's mesh) and, with ``options.cpu_offload``, on the CPU; detached either way."""
    out: dict[str, ValueType] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        value = param.detach()
        if options.full_state_dict:
            if isinstance(value, DTensor):
                value = value.full_tensor()
            if options.cpu_offload:
                value = value.to("cpu", copy=True)
        out[name] = value
    return out


def load_train_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    model_state: Mapping[str, object],
    optim_state: Mapping[str, object],
    options: StateDictOptions | None = None,
) -> None:
    """``set_state_dict``, leaving without optimizer state every parameter that has none in ``optim_state``.

    ``set_state_dict`` creates the moments of every parameter by the lr-0 step of :func:`train_state`, and a full
    (unsharded) load keeps them for the parameters the saved state does not name: AdamW would count their first
    real update as its second, unlike the run that saved the state. So an optimizer state without moments (saved
    before the first update) leaves the optimizer without any, and a parameter that had never had a gradient
    (the encoder of a modality not seen yet) has none after the load either.
    """
    set_state_dict(
        model,
        optimizer,
        model_state_dict=cast("dict[str, ValueType]", dict(model_state)),
        optim_state_dict=cast(OptimizerStateType, dict(optim_state)),
        options=options,
    )
    saved = cast("Mapping[str, object]", optim_state.get("state") or {})
    if not saved:
        optimizer.state.clear()
        return
    for name, param in model.named_parameters():
        if name not in saved:
            optimizer.state.pop(param, None)


def clone_state(state: object) -> object:
    """Deep copy of a nested state dict's tensors (DTensors stay DTensors on the same mesh)."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, Mapping):
        return {k: clone_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [clone_state(v) for v in state]
    return state
