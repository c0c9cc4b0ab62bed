"""relax_services: the services, controller, engines, weight sync and health manager of a relax run.

The public face, by topic:

- **run configuration**: :class:`RunConfig` (one typed config per component) and :func:`load_run_config`
  (YAML plus dotted overrides);
- **running**: :class:`Controller` drives one run and returns a :class:`RunResult`;
- **pipelines**: :func:`build_pipeline` wires a run's services (the builder follows relax-core's algorithm
  table);
- **services**: the Ray actors (Rollout, Reward, Reference, Critic, Trainer, Eval) and their shared base;
- **rows**: the typed schema of what crosses the queues, and the sample key format;
- **engines**: the rollout / training protocols, the engine registry (``rollout.engine``, ``trainer.engine``)
  and the built-in engines;
- **weights, data, health, checkpoints**: the weight stores, the prompt feeder, the health manager and the
  checkpoint manager.

Names are resolved on first use (each from the module listed in ``_EXPORTS``), so ``import relax_services`` and
the ``relax`` command start without importing torch, transformers or ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relax_services._lazy import lazy_exports

if TYPE_CHECKING:
    from relax_services.config import (
        DataConfig,
        EvalConfig,
        FaultSpec,
        HealthConfig,
        ModelConfig,
        QueueSettings,
        RolloutConfig,
        RunConfig,
        RunRewardConfig,
        RunSettings,
        TrainerConfig,
        load_run_config,
    )
    from relax_services.control.checkpoint import CheckpointManager
    from relax_services.control.controller import Controller, RunResult, init_ray, make_run_dir
    from relax_services.control.pipeline import (
        PIPELINE_BUILDERS,
        Pipeline,
        ServiceSpec,
        build_pipeline,
        pipeline_family,
    )
    from relax_services.data.feeder import Ledger, PromptFeeder
    from relax_services.engines import (
        ROLLOUT_ENGINES,
        TRAIN_ENGINES,
        Completion,
        HFRolloutEngine,
        LossFn,
        LossInputs,
        LossResult,
        RolloutEngine,
        RolloutEngineOptions,
        SamplingParams,
        TorchTrainEngine,
        TrainEngine,
        TrainSample,
        make_rollout_engine,
        make_train_engine,
    )
    from relax_services.faults.health import GlobalRestartNeeded, HealthManager, ServiceGaveUpError
    from relax_services.rows import (
        CriticFields,
        DataItem,
        HeldoutItem,
        ItemInfo,
        PromptRow,
        ReferenceFields,
        RewardFields,
        RolloutFields,
        SampleMeta,
        SampleRow,
        prompt_key_of,
        sample_key,
        split_sample_key,
    )
    from relax_services.services import (
        CriticService,
        EvalService,
        HealthMonitor,
        ReferenceService,
        RewardService,
        RolloutService,
        ServiceBase,
        TrainerService,
    )
    from relax_services.services._base import HealthHandle
    from relax_services.weights import InProcessWeightStore, RayWeightStore, WeightPoller, WeightStore

_EXPORTS: dict[str, str] = {
    # run configuration
    "RunConfig": "relax_services.config",
    "load_run_config": "relax_services.config",
    "ModelConfig": "relax_services.config",
    "DataConfig": "relax_services.config",
    "RunRewardConfig": "relax_services.config",
    "RolloutConfig": "relax_services.config",
    "TrainerConfig": "relax_services.config",
    "QueueSettings": "relax_services.config",
    "EvalConfig": "relax_services.config",
    "HealthConfig": "relax_services.config",
    "RunSettings": "relax_services.config",
    "FaultSpec": "relax_services.config",
    # running
    "Controller": "relax_services.control.controller",
    "RunResult": "relax_services.control.controller",
    "init_ray": "relax_services.control.controller",
    "make_run_dir": "relax_services.control.controller",
    # pipelines
    "build_pipeline": "relax_services.control.pipeline",
    "pipeline_family": "relax_services.control.pipeline",
    "PIPELINE_BUILDERS": "relax_services.control.pipeline",
    "Pipeline": "relax_services.control.pipeline",
    "ServiceSpec": "relax_services.control.pipeline",
    # services
    "RolloutService": "relax_services.services",
    "RewardService": "relax_services.services",
    "ReferenceService": "relax_services.services",
    "CriticService": "relax_services.services",
    "TrainerService": "relax_services.services",
    "EvalService": "relax_services.services",
    "ServiceBase": "relax_services.services",
    "HealthMonitor": "relax_services.services",
    "HealthHandle": "relax_services.services._base",
    # rows
    "SampleRow": "relax_services.rows",
    "RolloutFields": "relax_services.rows",
    "RewardFields": "relax_services.rows",
    "ReferenceFields": "relax_services.rows",
    "CriticFields": "relax_services.rows",
    "SampleMeta": "relax_services.rows",
    "PromptRow": "relax_services.rows",
    "ItemInfo": "relax_services.rows",
    "DataItem": "relax_services.rows",
    "HeldoutItem": "relax_services.rows",
    "sample_key": "relax_services.rows",
    "split_sample_key": "relax_services.rows",
    "prompt_key_of": "relax_services.rows",
    # engines
    "RolloutEngine": "relax_services.engines",
    "TrainEngine": "relax_services.engines",
    "Completion": "relax_services.engines",
    "SamplingParams": "relax_services.engines",
    "TrainSample": "relax_services.engines",
    "LossInputs": "relax_services.engines",
    "LossResult": "relax_services.engines",
    "LossFn": "relax_services.engines",
    "ROLLOUT_ENGINES": "relax_services.engines",
    "TRAIN_ENGINES": "relax_services.engines",
    "RolloutEngineOptions": "relax_services.engines",
    "make_rollout_engine": "relax_services.engines",
    "make_train_engine": "relax_services.engines",
    "HFRolloutEngine": "relax_services.engines",
    "TorchTrainEngine": "relax_services.engines",
    # weights
    "WeightStore": "relax_services.weights",
    "InProcessWeightStore": "relax_services.weights",
    "RayWeightStore": "relax_services.weights",
    "WeightPoller": "relax_services.weights",
    # data
    "PromptFeeder": "relax_services.data.feeder",
    "Ledger": "relax_services.data.feeder",
    # health and checkpoints
    "HealthManager": "relax_services.faults.health",
    "GlobalRestartNeeded": "relax_services.faults.health",
    "ServiceGaveUpError": "relax_services.faults.health",
    "CheckpointManager": "relax_services.control.checkpoint",
}

__all__ = [  # noqa: RUF022 - grouped by topic, as _EXPORTS
    # run configuration
    "RunConfig",
    "load_run_config",
    "ModelConfig",
    "DataConfig",
    "RunRewardConfig",
    "RolloutConfig",
    "TrainerConfig",
    "QueueSettings",
    "EvalConfig",
    "HealthConfig",
    "RunSettings",
    "FaultSpec",
    # running
    "Controller",
    "RunResult",
    "init_ray",
    "make_run_dir",
    # pipelines
    "build_pipeline",
    "pipeline_family",
    "PIPELINE_BUILDERS",
    "Pipeline",
    "ServiceSpec",
    # services
    "RolloutService",
    "RewardService",
    "ReferenceService",
    "CriticService",
    "TrainerService",
    "EvalService",
    "ServiceBase",
    "HealthMonitor",
    "HealthHandle",
    # rows
    "SampleRow",
    "RolloutFields",
    "RewardFields",
    "ReferenceFields",
    "CriticFields",
    "SampleMeta",
    "PromptRow",
    "ItemInfo",
    "DataItem",
    "HeldoutItem",
    "sample_key",
    "split_sample_key",
    "prompt_key_of",
    # engines
    "RolloutEngine",
    "TrainEngine",
    "Completion",
    "SamplingParams",
    "TrainSample",
    "LossInputs",
    "LossResult",
    "LossFn",
    "ROLLOUT_ENGINES",
    "TRAIN_ENGINES",
    "RolloutEngineOptions",
    "make_rollout_engine",
    "make_train_engine",
    "HFRolloutEngine",
    "TorchTrainEngine",
    # weights
    "WeightStore",
    "InProcessWeightStore",
    "RayWeightStore",
    "WeightPoller",
    # data
    "PromptFeeder",
    "Ledger",
    # health and checkpoints
    "HealthManager",
    "GlobalRestartNeeded",
    "ServiceGaveUpError",
    "CheckpointManager",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
