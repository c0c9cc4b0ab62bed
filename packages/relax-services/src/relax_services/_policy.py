"""The policy model every service builds, from the run's checkpoint folder (the default one included)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from relax_services.config import ModelConfig, RunConfig
from relax_services.engines import (
    HFRolloutConfig,
    HFRolloutEngine,
    SamplingParams,
    TorchTrainConfig,
    TorchTrainEngine,
    TorchValueEngine,
)
from relax_services.engines.registry import RolloutEngineOptions
from relax_services.models import Checkpoint, build_value_model, open_checkpoint

if TYPE_CHECKING:
    import torch

    from relax_services.trainer_group import TrainerGroup

__all__ = [
    "build_hf_rollout_engine",
    "build_policy",
    "build_train_engine",
    "build_trainer_group",
    "build_value_engine",
    "checkpoint_of",
    "sampling_params",
]


def checkpoint_of(cfg: ModelConfig) -> Checkpoint:
    """The run's validated checkpoint folder (``"tiny-omni"``: the default one, written once from ``cfg.seed``)."""
    return open_checkpoint(cfg.source, cfg.seed)


def build_policy(cfg: ModelConfig) -> Any:
    """Same weights in every process for the same config: the checkpoint folder loaded by its family's class."""
    return checkpoint_of(cfg).load_model()


def sampling_params(cfg: ModelConfig, **kwargs: Any) -> SamplingParams:
    """Sampling parameters with the checkpoint's eos and never-sample ids."""
    tokens = checkpoint_of(cfg).tokens
    return SamplingParams(suppressed_ids=tokens.never_sample, eos_id=tokens.eos_id, **kwargs)


def build_hf_rollout_engine(cfg: RunConfig, options: RolloutEngineOptions) -> HFRolloutEngine:
    """``rollout.engine=hf``: the transformers engine over the run's policy."""
    mode = options.partial_rollout if options.partial_rollout is not None else cfg.rollout.partial_rollout
    return HFRolloutEngine(build_policy(cfg.model), HFRolloutConfig(partial_rollout=mode))


def build_train_engine(cfg: RunConfig, model: torch.nn.Module | None = None) -> TorchTrainEngine:
    """``trainer.engine=torch``: the run's optimizer settings, micro-batches of whole groups, and a loss
    weighting that keeps gradient accumulation exact for the algorithm's loss aggregation."""
    return TorchTrainEngine(model if model is not None else build_policy(cfg.model), _train_config(cfg))


class _GivenModel:
    """Model factory of a rank that starts from given weights: pickled to each rank, so each gets its own copy."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __call__(self) -> torch.nn.Module:
        return self.model


def build_trainer_group(cfg: RunConfig, model: torch.nn.Module | None = None) -> TrainerGroup:
    """``trainer.engine=fsdp``: ``trainer.world_size`` Ray actors training one FSDP2-sharded policy with the
    single-process engine's settings (``micro_batch_groups`` per rank). gloo on CPU, NCCL on GPU.

    A hung rank stops the Trainer's loop, which the health manager's heartbeat timeout catches first; the group's
    own call timeout (twice that, at least two minutes) is the backstop that also bounds its collectives.
    """
    import functools

    from relax_services.trainer_group import TrainerGroup, TrainerGroupConfig
    from relax_services.trainer_plan import trainer_backend, trainer_layout

    train = _train_config(cfg)
    cuda = train.device.startswith("cuda")
    group = TrainerGroupConfig(
        world_size=cfg.trainer.world_size,
        backend=trainer_backend(train.device),
        step_timeout_s=max(2 * cfg.health.heartbeat_timeout_s, 120.0),
        num_cpus_per_rank=0.0,  # as every service actor: the ranks share the node's cores with the other services
        num_gpus_per_rank=1.0 if cuda else 0.0,
        resource=cfg.run.placement.get("trainer"),
        parallel=trainer_layout(cfg),  # the layout `relax plan` prints for this config
    )
    factory = functools.partial(build_policy, cfg.model) if model is None else _GivenModel(model)
    return TrainerGroup(factory, train, group=group)


def build_value_engine(cfg: RunConfig) -> TorchValueEngine:
    """The critic's engine: the policy's initial weights plus a zero value head, the run's optimizer settings."""
    return TorchValueEngine(build_value_model(build_policy(cfg.model)), _train_config(cfg))


def _train_config(cfg: RunConfig) -> TorchTrainConfig:
    opt = cfg.optimizer
    weighting: Literal["tokens", "samples"] = "tokens" if cfg.algorithm.loss_agg_mode == "token-mean" else "samples"
    from relax_services.trainer_plan import TRAINER_DEVICE

    return TorchTrainConfig(
        device=TRAINER_DEVICE,
        lr=opt.lr,
        betas=opt.betas,
        eps=opt.eps,
        weight_decay=opt.weight_decay,
        grad_clip=opt.grad_clip or 0.0,
        micro_batch_size=cfg.trainer.micro_batch_groups * cfg.algorithm.group_size,
        minibatches=cfg.trainer.minibatches,
        epochs=cfg.trainer.ppo_epochs,
        loss_weighting=weighting,
        warmup_steps=opt.warmup_steps,
        schedule=opt.schedule,
        total_steps=opt.total_steps or cfg.trainer.total_steps,
        min_lr_ratio=opt.min_lr_ratio,
        temperature=cfg.rollout.temperature,
        suppressed_ids=checkpoint_of(cfg.model).tokens.never_sample,
        seed=cfg.trainer.seed,
    )
