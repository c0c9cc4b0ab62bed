"""Engines behind the services: rollout (generation) and training backends, their protocols and their registry.

One folder per engine (``hf/``, ``torch/``, ``fsdp/``, ``vllm/``), each with its factory in its ``__init__``;
:mod:`~relax_services.engines.registry` holds the tables that name those factories and resolves them.

Every name is resolved on first use (``_EXPORTS``), so importing the registry (the driver and the preflight do)
imports no torch, and a run on the single-process engine never imports the FSDP2 stacks.
"""

from typing import TYPE_CHECKING

from relax_services._lazy import lazy_exports

if TYPE_CHECKING:
    from relax_services.engines.fsdp.train import (
        FSDPConfig,
        FSDPTrainEngine,
        FSDPValueEngine,
    )
    from relax_services.engines.hf.rollout import (
        HFRolloutConfig,
        HFRolloutEngine,
    )
    from relax_services.engines.protocols import (
        LOSS_MASK_FIELD,
        PARTIAL_ROLLOUT_MODES,
        Completion,
        FinishReason,
        LossFn,
        LossInputs,
        LossResult,
        MediaSpan,
        PartialRolloutMode,
        ReleasesWeights,
        RolloutEngine,
        TrainEngine,
        TrainSample,
        WeightPoll,
    )
    from relax_services.engines.registry import (
        OPTIONAL_EXTRAS,
        ROLLOUT_ENGINES,
        TRAIN_ENGINES,
        RolloutEngineOptions,
        check_engines,
        make_rollout_engine,
        make_train_engine,
    )
    from relax_services.engines.sampling import (
        SamplingParams,
        policy_logprobs,
        sample_tokens,
        sampling_params,
        truncate,
    )
    from relax_services.engines.scoring import (
        TokenScores,
        score_responses,
        score_values,
    )
    from relax_services.engines.torch.train import (
        TorchTrainConfig,
        TorchTrainEngine,
        TorchValueEngine,
    )

_EXPORTS: dict[str, str] = {
    "LOSS_MASK_FIELD": "relax_services.engines.protocols",
    "PARTIAL_ROLLOUT_MODES": "relax_services.engines.protocols",
    "Completion": "relax_services.engines.protocols",
    "FinishReason": "relax_services.engines.protocols",
    "LossFn": "relax_services.engines.protocols",
    "LossInputs": "relax_services.engines.protocols",
    "LossResult": "relax_services.engines.protocols",
    "MediaSpan": "relax_services.engines.protocols",
    "PartialRolloutMode": "relax_services.engines.protocols",
    "ReleasesWeights": "relax_services.engines.protocols",
    "RolloutEngine": "relax_services.engines.protocols",
    "TrainEngine": "relax_services.engines.protocols",
    "TrainSample": "relax_services.engines.protocols",
    "WeightPoll": "relax_services.engines.protocols",
    "OPTIONAL_EXTRAS": "relax_services.engines.registry",
    "ROLLOUT_ENGINES": "relax_services.engines.registry",
    "TRAIN_ENGINES": "relax_services.engines.registry",
    "RolloutEngineOptions": "relax_services.engines.registry",
    "check_engines": "relax_services.engines.registry",
    "make_rollout_engine": "relax_services.engines.registry",
    "make_train_engine": "relax_services.engines.registry",
    "HFRolloutConfig": "relax_services.engines.hf.rollout",
    "HFRolloutEngine": "relax_services.engines.hf.rollout",
    "SamplingParams": "relax_services.engines.sampling",
    "policy_logprobs": "relax_services.engines.sampling",
    "sample_tokens": "relax_services.engines.sampling",
    "sampling_params": "relax_services.engines.sampling",
    "truncate": "relax_services.engines.sampling",
    "TokenScores": "relax_services.engines.scoring",
    "score_responses": "relax_services.engines.scoring",
    "score_values": "relax_services.engines.scoring",
    "TorchTrainConfig": "relax_services.engines.torch.train",
    "TorchTrainEngine": "relax_services.engines.torch.train",
    "TorchValueEngine": "relax_services.engines.torch.train",
    "FSDPConfig": "relax_services.engines.fsdp.train",
    "FSDPTrainEngine": "relax_services.engines.fsdp.train",
    "FSDPValueEngine": "relax_services.engines.fsdp.train",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

# protocols and records
__all__ = [
    "LOSS_MASK_FIELD",
    "PARTIAL_ROLLOUT_MODES",
    "Completion",
    "FinishReason",
    "LossFn",
    "LossInputs",
    "LossResult",
    "MediaSpan",
    "PartialRolloutMode",
    "ReleasesWeights",
    "RolloutEngine",
    "TrainEngine",
    "TrainSample",
    "WeightPoll",
]

# the engine registry (rollout.engine, trainer.engine)
__all__ += [
    "OPTIONAL_EXTRAS",
    "ROLLOUT_ENGINES",
    "TRAIN_ENGINES",
    "RolloutEngineOptions",
    "check_engines",
    "make_rollout_engine",
    "make_train_engine",
]

# rollout
__all__ += [
    "HFRolloutConfig",
    "HFRolloutEngine",
    "SamplingParams",
    "policy_logprobs",
    "sample_tokens",
    "sampling_params",
    "truncate",
]

# training
__all__ += [
    "TokenScores",
    "TorchTrainConfig",
    "TorchTrainEngine",
    "TorchValueEngine",
    "score_responses",
    "score_values",
]

# distributed training (FSDP2)
__all__ += [
    "FSDPConfig",
    "FSDPTrainEngine",
    "FSDPValueEngine",
]
