"""The policy model every service builds: the tiny omni thinker, or a local transformers checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from relax_services.config import ModelConfig, RunConfig
from relax_services.engines import (
    HFRolloutConfig,
    HFRolloutEngine,
    TorchTrainConfig,
    TorchTrainEngine,
    TorchValueEngine,
)
from relax_services.engines.registry import RolloutEngineOptions
from relax_services.models import OmniModel, build_tiny_omni, build_value_model, load_model

__all__ = ["build_hf_rollout_engine", "build_policy", "build_train_engine", "build_value_engine"]


def build_policy(cfg: ModelConfig) -> OmniModel:
    """Same weights in every process for the same config: built from ``cfg.seed`` or loaded from disk."""
    if cfg.source == "tiny-omni":
        return build_tiny_omni(seed=cfg.seed)
    path = Path(cfg.source)
    if not path.is_dir():
        raise FileNotFoundError(f"model.source={cfg.source!r} is neither 'tiny-omni' nor a local checkpoint directory")
    return load_model(path)


def build_hf_rollout_engine(cfg: RunConfig, options: RolloutEngineOptions) -> HFRolloutEngine:
    """``rollout.engine=hf``: the transformers engine over the run's policy."""
    mode = options.partial_rollout if options.partial_rollout is not None else cfg.rollout.partial_rollout
    return HFRolloutEngine(build_policy(cfg.model), HFRolloutConfig(partial_rollout=mode))


def build_train_engine(cfg: RunConfig, model: OmniModel | None = None) -> TorchTrainEngine:
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
        seed=cfg.trainer.seed,
    )
