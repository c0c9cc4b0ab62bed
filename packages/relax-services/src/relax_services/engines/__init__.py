"""Engines behind the services: rollout (generation) and training backends, and their protocols.

The FSDP2 engine's names are resolved on first use (``_EXPORTS``): its module imports ``torch.distributed``'s
checkpoint and FSDP stacks (seconds of a process's start-up), which a run on the single-process ``torch`` engine
never needs.
"""

from typing import TYPE_CHECKING

from relax_services._lazy import lazy_exports
from relax_services.engines.hf_rollout import HFRolloutConfig, HFRolloutEngine
from relax_services.engines.protocols import (
    PARTIAL_ROLLOUT_MODES,
    Completion,
    FinishReason,
    LossFn,
    LossInputs,
    LossResult,
    PartialRolloutMode,
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
from relax_services.engines.sampling import SamplingParams, policy_logprobs, sample_tokens, truncate
from relax_services.engines.scoring import TokenScores, score_responses, score_values
from relax_services.engines.torch_train import TorchTrainConfig, TorchTrainEngine, TorchValueEngine
from relax_services.engines.weight_buckets import (
    BucketLoader,
    InProcessWeightStream,
    PackedBucket,
    SyncStats,
    WeightStream,
    stream_buckets,
)

if TYPE_CHECKING:
    from relax_services.engines.fsdp_train import FSDPConfig, FSDPTrainEngine, FSDPValueEngine

_EXPORTS: dict[str, str] = {
    "FSDPConfig": "relax_services.engines.fsdp_train",
    "FSDPTrainEngine": "relax_services.engines.fsdp_train",
    "FSDPValueEngine": "relax_services.engines.fsdp_train",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

# protocols and records
__all__ = [
    "PARTIAL_ROLLOUT_MODES",
    "Completion",
    "FinishReason",
    "LossFn",
    "LossInputs",
    "LossResult",
    "PartialRolloutMode",
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

# distributed training (FSDP2) and bucketed weight sync
__all__ += [
    "BucketLoader",
    "FSDPConfig",
    "FSDPTrainEngine",
    "FSDPValueEngine",
    "InProcessWeightStream",
    "PackedBucket",
    "SyncStats",
    "WeightStream",
    "stream_buckets",
]
