"""The run config: one typed section per component (:class:`RunConfig`), loaded from YAML plus dotted overrides
(:func:`load_run_config`), its cross-field rules, and what ``--resume`` may change.

The sections live in the modules beside this one; the names below are the face the rest of the package uses.
"""

from relax_services.config.run_config import (
    ACTOR_TARGETS,
    CriticConfig,
    DataConfig,
    EvalConfig,
    FaultSpec,
    HealthConfig,
    LoraConfig,
    MetricsConfig,
    ModelConfig,
    QueueSettings,
    ReferenceConfig,
    RolloutConfig,
    RunConfig,
    RunRewardConfig,
    RunSettings,
    TrainerConfig,
    VLLMSettings,
    load_run_config,
)

__all__ = [
    "ACTOR_TARGETS",
    "CriticConfig",
    "DataConfig",
    "EvalConfig",
    "FaultSpec",
    "HealthConfig",
    "LoraConfig",
    "MetricsConfig",
    "ModelConfig",
    "QueueSettings",
    "ReferenceConfig",
    "RolloutConfig",
    "RunConfig",
    "RunRewardConfig",
    "RunSettings",
    "TrainerConfig",
    "VLLMSettings",
    "load_run_config",
]
