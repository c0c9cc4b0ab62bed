"""The FSDP2 training engine (``trainer.engine=fsdp``): a group of Ray actors, one per rank, training one
FSDP2-sharded policy (gloo on CPU, NCCL on GPU), with its layout, tensor parallelism and sharded checkpoints.

Only the factory is defined here; the engine's modules import ``torch.distributed``'s FSDP and checkpoint stacks
(seconds of a process's start-up) and are imported when a group is built.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from relax_services.config import RunConfig
    from relax_services.engines.fsdp.group import TrainerGroup
    from relax_services.engines.protocols import RankOptions

__all__ = ["build_trainer_group"]


class _GivenModel:
    """Model factory of a rank that starts from given weights: pickled to each rank, so each gets its own copy."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __call__(self) -> torch.nn.Module:
        return self.model


def build_trainer_group(
    cfg: RunConfig,
    model: torch.nn.Module | None = None,
    *,
    role: str = "trainer",
    placement: RankOptions | None = None,
) -> TrainerGroup:
    """``trainer.engine=fsdp``: ``trainer.world_size`` Ray actors training one FSDP2-sharded policy with the
    single-process engine's settings (``micro_batch_groups`` per rank). gloo on CPU, NCCL on GPU, each rank in its
    ``placement`` bundle with ``trainer.gpus_per_rank`` GPUs (None: Ray places the ranks).

    A hung rank stops the Trainer's loop, which the health manager's heartbeat timeout catches first; the group's
    own call timeout (twice that, at least two minutes) is the backstop that also bounds its collectives.
    """
    from relax_services.config.devices import role_gpus
    from relax_services.engines.fsdp.group import TrainerGroup, TrainerGroupConfig
    from relax_services.engines.fsdp.train import FSDPConfig
    from relax_services.engines.torch import train_config
    from relax_services.engines.trainer_plan import trainer_backend, trainer_layout
    from relax_services.models.policy import PolicyFactory

    if role != "trainer":
        raise ValueError(f"trainer.engine='fsdp' trains the policy; the {role} scores with a one-process engine")
    train = train_config(cfg)
    if cfg.model.lora is not None:  # the ranks train the policy's adapters; the full KL's reference stays plain
        train = dataclasses.replace(train, lora=cfg.model.lora)
    group = TrainerGroupConfig(
        world_size=cfg.trainer.world_size,
        backend=trainer_backend(train.device),
        step_timeout_s=max(2 * cfg.health.heartbeat_timeout_s, 120.0),
        num_cpus_per_rank=0.0,  # as every service actor: the ranks share the node's cores with the other services
        num_gpus_per_rank=role_gpus(cfg, "trainer"),
        resource=cfg.run.placement.get("trainer"),
        parallel=trainer_layout(cfg),  # the layout `relax plan` prints for this config
    )
    factory = PolicyFactory(cfg.model) if model is None else _GivenModel(model)
    shard = FSDPConfig(**cfg.trainer.fsdp.model_dump())
    # The full KL's reference: the initial checkpoint on every rank (not the given weights), as the Reference loads it.
    reference = PolicyFactory(cfg.model) if train.full_kl else None
    return TrainerGroup(factory, train, shard, group=group, placement=placement, reference_factory=reference)
