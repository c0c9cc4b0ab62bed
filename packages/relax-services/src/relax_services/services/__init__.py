"""The service actors: Rollout, Reward, Reference, Critic, Trainer and the held-out Evaluator.

Names are resolved on first use (each from the module listed in ``_EXPORTS``): a Ray actor process unpickles its
service class by importing that class's module, which imports this package first, and the Reward service's
process must not import the model stack (torch, transformers) that the other services' modules bring.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relax_services._lazy import lazy_exports

if TYPE_CHECKING:
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

_EXPORTS: dict[str, str] = {
    "HealthMonitor": "relax_services.services._base",
    "ServiceBase": "relax_services.services._base",
    "CriticService": "relax_services.services.critic",
    "EvalService": "relax_services.services.evaluator",
    "ReferenceService": "relax_services.services.reference",
    "RewardService": "relax_services.services.reward",
    "decode_response": "relax_services.services.reward",
    "RolloutService": "relax_services.services.rollout",
    "sampling_seed": "relax_services.services.rollout",
    "TrainerService": "relax_services.services.trainer",
    "build_train_samples": "relax_services.services.trainer",
    "informative_rows": "relax_services.services.trainer",
    "make_loss_fn": "relax_services.services.trainer",
    "trainer_fields": "relax_services.services.trainer",
}

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


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
