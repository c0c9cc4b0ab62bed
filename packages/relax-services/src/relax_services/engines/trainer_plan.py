"""The Trainer's parallel plan as one description: ``relax plan`` prints it from a run config, ``relax train``
prints it at start and saves it in the run folder, and the Trainer group's rank 0 writes the same text from the
``DeviceMesh`` it actually built, which the Trainer service records in the run's metrics.

The config side (:func:`trainer_plan_text`) derives the rank groups from relax-parallel's closed-form layout
(:meth:`relax_parallel.ParallelPlan.rank_groups`); the realised side (:func:`realised_plan_text`) reads them
from the mesh torch built and from the process groups it created. One formatter (:func:`describe_plan`) writes
both, so the two texts are equal exactly when the run realises the plan the config describes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Literal

from relax_parallel import MESH_DIMS, ParallelConfig, ParallelPlan
from relax_services.config.devices import device_of
from relax_services.config.trainer_group import GROUP_TRAIN_ENGINES, data_parallel, rank_split

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from relax_services.config import RunConfig

__all__ = [
    "describe_plan",
    "realised_plan_text",
    "trainer_backend",
    "trainer_layout",
    "trainer_plan",
    "trainer_plan_text",
]


def trainer_backend(device: str) -> Literal["gloo", "nccl"]:
    """The process-group backend of a Trainer group on ``device``: NCCL on CUDA, gloo otherwise."""
    return "nccl" if device.startswith("cuda") else "gloo"


def trainer_layout(cfg: RunConfig) -> ParallelConfig:
    """The Trainer group's layout from the run config: ``world_size / (tensor_parallel × sequence_parallel)``
    data-parallel ranks of ``tensor_parallel × sequence_parallel`` ranks each (``trainer.sequence_parallel`` is the
    plan's ``cp`` dimension, realised as Ulysses sequence parallelism); a data-parallel rank's micro-batch is the
    smaller of ``trainer.micro_batch_groups × algorithm.group_size`` and its share of a minibatch (what
    :class:`~relax_services.engines.FSDPTrainEngine` forwards at once)."""
    _, per_rank = rank_split(cfg)
    micro = min(cfg.trainer.micro_batch_groups * cfg.algorithm.group_size, per_rank)
    trainer = cfg.trainer
    return ParallelConfig(
        dp=data_parallel(cfg), tp=trainer.tensor_parallel, cp=trainer.sequence_parallel, micro_batch=max(1, micro)
    )


def trainer_plan(cfg: RunConfig) -> ParallelPlan:
    """relax-parallel's plan object for the run's Trainer (a given layout, no predictions)."""
    return ParallelPlan.from_config(trainer_layout(cfg), service="trainer")


def describe_plan(
    layout: ParallelConfig,
    backend: str,
    groups: Mapping[str, Sequence[Sequence[int]]],
    rank0_groups: Mapping[str, Sequence[int]],
) -> str:
    """The plan text of a Trainer group.

    Args:
        layout: The group's parallel degrees.
        backend: Process-group backend (``gloo`` or ``nccl``).
        groups: For each of ``MESH_DIMS``, every rank group along that dimension, in mesh order.
        rank0_groups: For each of ``MESH_DIMS``, the ranks of rank 0's process group along it.
    """
    shape = tuple(len(groups[d][0]) for d in MESH_DIMS)
    lines = [
        f"[trainer] engine fsdp, {layout.world_size} rank(s) over {backend}: {layout.short()}",
        f"  mesh       ({', '.join(MESH_DIMS)}) = {shape}",
    ]
    for dim in MESH_DIMS:
        lines.append(f"  {dim + ' groups':<10} {[list(g) for g in groups[dim]]}; rank 0 in {list(rank0_groups[dim])}")
    lines.append(
        f"  - FSDP2 shards parameters, gradients and optimizer state over dp={layout.dp}; every rank trains on "
        f"an equal share of each minibatch, in micro-batches of at most {layout.micro_batch} samples"
    )
    if layout.cp > 1:
        lines.append(
            f"  - sequence parallelism (Ulysses) over the cp dimension, sp={layout.cp}: each rank runs a contiguous "
            f"1/{layout.cp} of every sequence, with an all-to-all over heads around each attention; FSDP2 shards "
            f"over dp × sp = {layout.dp * layout.cp}"
        )
    if layout.tp > 1:
        lines.append(
            f"  - each decoder block's attention and MLP are split over tp={layout.tp} ranks (colwise q/k/v, "
            "gate/up; rowwise o, down); the ranks of a tp group train on the same samples"
        )
    return "\n".join(lines)


def trainer_plan_text(cfg: RunConfig) -> str:
    """What the run's Trainer will realise, from the config alone (no model, no process started)."""
    trainer = cfg.trainer
    if trainer.engine not in GROUP_TRAIN_ENGINES:
        return (
            f"[trainer] engine {trainer.engine}: one process, no process group (trainer.world_size="
            f"{trainer.world_size})"
        )
    plan = trainer_plan(cfg)
    all_groups = plan.rank_groups()
    groups = {d: all_groups[d] for d in MESH_DIMS}
    rank0 = {d: next(g for g in groups[d] if 0 in g) for d in MESH_DIMS}
    return describe_plan(plan.config, trainer_backend(device_of(cfg, "trainer")), groups, rank0)


def realised_plan_text(layout: ParallelConfig, backend: str, mesh: DeviceMesh) -> str:
    """The plan text read back from a built mesh (call on rank 0): every rank group from the mesh's rank
    layout, rank 0's own groups from the process groups torch created for it.

    Raises:
        ValueError: If the mesh's dimension names are not ``MESH_DIMS``.
    """
    import torch.distributed as dist

    if tuple(mesh.mesh_dim_names or ()) != MESH_DIMS:
        raise ValueError(f"the Trainer mesh must have dimensions {MESH_DIMS}, got {mesh.mesh_dim_names}")
    ranks = mesh.mesh  # [pp, dp, cp, tp] global ranks
    groups: dict[str, list[list[int]]] = {}
    rank0: dict[str, list[int]] = {}
    for axis, dim in enumerate(MESH_DIMS):
        groups[dim] = ranks.movedim(axis, -1).reshape(-1, ranks.shape[axis]).tolist()
        rank0[dim] = sorted(dist.get_process_group_ranks(mesh.get_group(dim)))
    return describe_plan(layout, backend, groups, rank0)
