"""relax_parallel: parallelism planning for relax services.

Describe a model (``ModelSpec``, from a transformers ``config.json`` or a shipped preset), a workload
(``WorkloadSpec``: modality mix, sequence lengths, batch) and a cluster (``ClusterSpec``); get a
``ParallelPlan`` per service with predicted memory, step time and the reason for every choice, a GPU split
between rollout, trainer, reference and critic, and the plan realised as a torch ``DeviceMesh`` or
megatron-core ``initialize_model_parallel`` arguments.
"""

from relax_parallel._config import RECOMPUTE_MODES, ParallelConfig
from relax_parallel._hf_config import PRESETS, load_model_spec, model_spec_from_hf_config
from relax_parallel._memory import (
    MemoryBreakdown,
    inference_weight_bytes,
    kv_cache_bytes_per_token,
    layer_activation_bytes,
    layer_activation_coefficient,
    training_memory,
)
from relax_parallel._plan import EXPERT_MESH_DIMS, MEGATRON_ORDER, MESH_DIMS, ParallelPlan
from relax_parallel._rollout import plan_rollout
from relax_parallel._search import InfeasiblePlanError, config_violations, enumerate_configs, plan_training
from relax_parallel._specs import (
    MODALITIES,
    AudioEncoderSpec,
    ClusterSpec,
    ModelSpec,
    VisionEncoderSpec,
    WorkloadSpec,
)
from relax_parallel._split import ALGORITHMS, ServiceSplit, Throughputs, split_services
from relax_parallel._strategy import ModalityStrategy
from relax_parallel._time import (
    GenerationEstimate,
    TimeBreakdown,
    decoder_forward_flops_per_token,
    generation_estimate,
    pipeline_bubble_fraction,
    ring_allreduce_seconds,
    step_flops,
    training_step_time,
)

__all__ = [  # noqa: RUF022 - grouped by topic
    # Specifications
    "MODALITIES",
    "PRESETS",
    "AudioEncoderSpec",
    "ClusterSpec",
    "ModelSpec",
    "VisionEncoderSpec",
    "WorkloadSpec",
    "load_model_spec",
    "model_spec_from_hf_config",
    # Cost model: memory
    "MemoryBreakdown",
    "inference_weight_bytes",
    "kv_cache_bytes_per_token",
    "layer_activation_bytes",
    "layer_activation_coefficient",
    "training_memory",
    # Cost model: time
    "GenerationEstimate",
    "TimeBreakdown",
    "decoder_forward_flops_per_token",
    "generation_estimate",
    "pipeline_bubble_fraction",
    "ring_allreduce_seconds",
    "step_flops",
    "training_step_time",
    # Layouts and search
    "RECOMPUTE_MODES",
    "InfeasiblePlanError",
    "ParallelConfig",
    "config_violations",
    "enumerate_configs",
    "plan_rollout",
    "plan_training",
    # Plans and realisation
    "EXPERT_MESH_DIMS",
    "MEGATRON_ORDER",
    "MESH_DIMS",
    "ModalityStrategy",
    "ParallelPlan",
    # Service split
    "ALGORITHMS",
    "ServiceSplit",
    "Throughputs",
    "split_services",
]
