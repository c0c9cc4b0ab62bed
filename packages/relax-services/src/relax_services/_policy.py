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

__all__ = [
    "build_hf_rollout_engine",
    "build_policy",
    "build_train_engine",
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


def build_value_engine(cfg: RunConfig) -> TorchValueEngine:
    """The critic's engine: the policy's initial weights plus a zero value head, the run's optimizer settings."""
    return TorchValueEngine(build_value_model(build_policy(cfg.model)), _train_config(cfg))


def _train_config(cfg: RunConfig) -> TorchTrainConfig:
    opt = cfg.optimizer
    weighting: Literal["tokens", "samples"] = "tokens" if cfg.algorithm.loss_agg_mode == "token-mean" else "samples"
    return TorchTrainConfig(
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
