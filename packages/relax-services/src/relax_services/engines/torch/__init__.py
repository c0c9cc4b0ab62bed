"""The single-process torch engines (``trainer.engine=torch``): the policy's and the critic's, with the run's
optimizer settings."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal

from relax_services.config.devices import device_of, dtype_of, trainer_autocast
from relax_services.config.threads import threads_of
from relax_services.engines.torch.train import TorchTrainConfig, TorchTrainEngine, TorchValueEngine
from relax_services.models import build_value_model
from relax_services.models.policy import build_policy, checkpoint_of

if TYPE_CHECKING:
    import torch

    from relax_services.config import RunConfig

__all__ = [
    "TorchTrainConfig",
    "TorchTrainEngine",
    "TorchValueEngine",
    "build_train_engine",
    "build_value_engine",
    "train_config",
]


def build_train_engine(
    cfg: RunConfig, model: torch.nn.Module | None = None, *, role: str = "trainer", placement: object = None
) -> TorchTrainEngine:
    """``trainer.engine=torch``: the run's optimizer settings, micro-batches of whole groups, and a loss
    weighting that keeps gradient accumulation exact for the algorithm's loss aggregation, on ``role``'s device
    and dtype (the Reference builds one to score with). The Trainer's trains ``model.lora``'s adapters when set.
    ``placement`` is the group engines'; one process has its own already."""
    del placement
    config = train_config(cfg, role)
    # The full KL's frozen reference: the initial checkpoint, loaded as the Reference service's engine loads it.
    reference = build_policy(cfg.model) if config.full_kl else None
    if role == "trainer" and cfg.model.lora is not None:  # a scoring role (the Reference) keeps the plain model
        config = dataclasses.replace(config, lora=cfg.model.lora)
    return TorchTrainEngine(model if model is not None else build_policy(cfg.model), config, reference)


def build_value_engine(cfg: RunConfig, role: str = "trainer") -> TorchValueEngine:
    """The critic's engine: the policy's initial weights plus a zero value head, the run's optimizer settings, on
    ``role``'s device (the Trainer trains one, the Critic scores with one)."""
    config = dataclasses.replace(train_config(cfg, role), full_kl=False)  # a critic has no KL term
    return TorchValueEngine(build_value_model(build_policy(cfg.model)), config)


def train_config(cfg: RunConfig, role: str = "trainer") -> TorchTrainConfig:
    """The engine settings a run config gives every training engine (the FSDP2 group's ranks included), on the
    device and in the weight dtype of ``role`` (the Trainer's, or a scoring role's: the Reference, the Critic).
    Only the Trainer's policy engine holds the full KL's frozen reference (in the Reference service's dtype)."""
    opt = cfg.optimizer
    weighting: Literal["tokens", "samples"] = "tokens" if cfg.algorithm.loss_agg_mode == "token-mean" else "samples"
    return TorchTrainConfig(
        device=device_of(cfg, role),
        param_dtype=dtype_of(cfg, role),
        autocast=trainer_autocast(cfg),
        lr=opt.lr,
        betas=opt.betas,
        eps=opt.eps,
        weight_decay=opt.weight_decay,
        grad_clip=opt.grad_clip or 0.0,
        micro_batch_size=cfg.trainer.micro_batch_groups * cfg.algorithm.group_size,
        max_tokens_per_micro_batch=cfg.trainer.max_tokens_per_micro_batch,
        packing=cfg.trainer.packing,
        activation_checkpointing=cfg.trainer.activation_checkpointing,
        minibatches=cfg.trainer.minibatches,
        epochs=cfg.trainer.ppo_epochs,
        loss_weighting=weighting,
        warmup_steps=opt.warmup_steps,
        schedule=opt.schedule,
        total_steps=opt.total_steps or cfg.trainer.total_steps,
        min_lr_ratio=opt.min_lr_ratio,
        temperature=cfg.rollout.temperature,
        suppressed_ids=checkpoint_of(cfg.model).tokens.never_sample,
        full_kl=cfg.algorithm.uses_full_kl and role == "trainer",  # the loss's exact KL reads LossInputs.full_kl
        reference_dtype=dtype_of(cfg, "reference"),
        seed=cfg.trainer.seed,
        scoring_chunk_tokens=cfg.trainer.scoring_chunk_tokens,
        intra_op_threads=threads_of(cfg),
    )
