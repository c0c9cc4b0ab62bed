"""The service actors: Rollout, Reward, Reference, Critic, Trainer and the held-out Evaluator."""

from relax_services.services._base import HealthMonitor, ServiceBase
from relax_services.services.critic import CriticService
from relax_services.services.evaluator import EvalService
from relax_services.services.reference import ReferenceService
from relax_services.services.reward import RewardService, decode_response
from relax_services.services.rollout import RolloutService, sampling_seed
from relax_services.services.trainer import (
    TrainerService,
    build_train_samples,
    informative_rows,
    make_loss_fn,
    trainer_fields,
)

__all__ = [
    "CriticService",
    "EvalService",
    "HealthMonitor",
    "ReferenceService",
    "RewardService",
    "RolloutService",
    "ServiceBase",
    "TrainerService",
    "build_train_samples",
    "decode_response",
    "informative_rows",
    "make_loss_fn",
    "sampling_seed",
    "trainer_fields",
]
