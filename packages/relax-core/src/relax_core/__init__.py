"""relax_core: typed configs and the RL math of relax.

Configs are small pydantic models loaded from YAML plus dotted overrides; the math is plain
torch on ``[B, T]`` response-token tensors with a loss mask. Nothing here imports ray,
transformers or a media library, and the configs load without torch: the math modules are imported on first
use of one of their names, so a config error is reported before any heavy import.
"""

from typing import TYPE_CHECKING, Any

from relax_core._names import KLEstimator, LossAggMode
from relax_core.algorithms.table import (
    ALGORITHMS,
    AdvantageFn,
    AlgorithmSpec,
    EstimatorInputs,
    algorithm_spec,
    estimator_names,
    off_policy_alternatives,
    preset_names,
)
from relax_core.config.base import (
    ConfigError,
    ConfigIssue,
    ConfigModel,
    apply_overrides,
    config_error_from,
    dump_config,
    load_config,
    parse_override,
    read_yaml_mapping,
)
from relax_core.config.components import (
    AdvantageEstimator,
    AlgorithmConfig,
    KLControlConfig,
    OptimizerConfig,
    PolicyLossName,
    StalenessConfig,
    load_preset,
    lr_multiplier,
)
from relax_core.config.data import DataFileSpec, RowSchema
from relax_core.config.presets import PRESET_NAMES, PresetName
from relax_core.rewards.basic import (
    exact_match_reward,
    extract_boxed,
    extract_choice,
    format_reward,
    math_reward,
    multiple_choice_reward,
    normalize_number,
)
from relax_core.rewards.extras import length_penalty_reward, math_verify_reward, regex_reward, weighted_reward
from relax_core.rewards.registry import (
    REWARD_REGISTRY,
    AsyncRewardFn,
    BatchedRewardFn,
    RewardFn,
    resolve_reward_fn,
)
from relax_core.rewards.remote import RemoteReward, RemoteRewardConfig, RemoteRewardError
from relax_core.rewards.runner import (
    RewardOutcome,
    RewardRequest,
    RewardRunner,
    RewardRunnerConfig,
    RewardSpec,
    RewardStats,
    build_reward_runner,
)
from relax_core.rewards.user import CallStyle, RewardKind, call_style, import_file, load_reward_fn, parse_reward_value

if TYPE_CHECKING:  # the lazily imported names, for type checkers
    from relax_core.algorithms.advantages import (
        VTraceOutput,
        broadcast_to_tokens,
        discounted_returns,
        dynamic_sampling_keep,
        gae_advantages,
        gpg_advantages,
        group_index,
        grpo_advantages,
        reinforce_pp_advantages,
        reinforce_pp_baseline_advantages,
        rloo_advantages,
        vtrace,
    )
    from relax_core.algorithms.estimate import AdvantageOutput, compute_advantages, outcome_token_rewards
    from relax_core.algorithms.kl import (
        entropy_from_logits,
        kl_estimate,
        kl_full,
        kl_penalised_rewards,
        token_logprobs,
        value_loss,
    )
    from relax_core.algorithms.kl_control import KLController
    from relax_core.algorithms.loss import (
        POLICY_LOSSES,
        Surrogate,
        SurrogateInputs,
        compute_policy_loss,
        policy_loss_units,
    )
    from relax_core.algorithms.masked import (
        aggregate_loss,
        aggregation_units,
        masked_mean,
        masked_sum,
        masked_var,
        masked_whiten,
    )
    from relax_core.algorithms.policy_losses import (
        ImportanceWeights,
        cispo_loss,
        clip_cov_loss,
        dppo_loss,
        dro_loss,
        geo_mean_loss,
        gspo_log_ratio,
        importance_weights,
        kl_cov_loss,
        pg_loss,
        ppo_clip_loss,
        rejection_keep,
        sapo_loss,
    )

_LAZY: dict[str, str] = {
    "VTraceOutput": "relax_core.algorithms.advantages",
    "broadcast_to_tokens": "relax_core.algorithms.advantages",
    "discounted_returns": "relax_core.algorithms.advantages",
    "dynamic_sampling_keep": "relax_core.algorithms.advantages",
    "gae_advantages": "relax_core.algorithms.advantages",
    "remax_advantages": "relax_core.algorithms.advantages",
    "opo_advantages": "relax_core.algorithms.advantages",
    "grpo_passk_advantages": "relax_core.algorithms.advantages",
    "gpg_advantages": "relax_core.algorithms.advantages",
    "group_index": "relax_core.algorithms.advantages",
    "grpo_advantages": "relax_core.algorithms.advantages",
    "reinforce_pp_advantages": "relax_core.algorithms.advantages",
    "reinforce_pp_baseline_advantages": "relax_core.algorithms.advantages",
    "rloo_advantages": "relax_core.algorithms.advantages",
    "vtrace": "relax_core.algorithms.advantages",
    "AdvantageOutput": "relax_core.algorithms.estimate",
    "compute_advantages": "relax_core.algorithms.estimate",
    "outcome_token_rewards": "relax_core.algorithms.estimate",
    "entropy_from_logits": "relax_core.algorithms.kl",
    "kl_estimate": "relax_core.algorithms.kl",
    "kl_full": "relax_core.algorithms.kl",
    "kl_penalised_rewards": "relax_core.algorithms.kl",
    "token_logprobs": "relax_core.algorithms.kl",
    "value_loss": "relax_core.algorithms.kl",
    "POLICY_LOSSES": "relax_core.algorithms.loss",
    "Surrogate": "relax_core.algorithms.loss",
    "SurrogateInputs": "relax_core.algorithms.loss",
    "KLController": "relax_core.algorithms.kl_control",
    "compute_policy_loss": "relax_core.algorithms.loss",
    "policy_loss_units": "relax_core.algorithms.loss",
    "aggregate_loss": "relax_core.algorithms.masked",
    "aggregation_units": "relax_core.algorithms.masked",
    "masked_mean": "relax_core.algorithms.masked",
    "masked_sum": "relax_core.algorithms.masked",
    "masked_var": "relax_core.algorithms.masked",
    "masked_whiten": "relax_core.algorithms.masked",
    "ImportanceWeights": "relax_core.algorithms.policy_losses",
    "cispo_loss": "relax_core.algorithms.policy_losses",
    "pg_loss": "relax_core.algorithms.policy_losses",
    "kl_cov_loss": "relax_core.algorithms.policy_losses",
    "geo_mean_loss": "relax_core.algorithms.policy_losses",
    "dro_loss": "relax_core.algorithms.policy_losses",
    "dppo_loss": "relax_core.algorithms.policy_losses",
    "clip_cov_loss": "relax_core.algorithms.policy_losses",
    "gspo_log_ratio": "relax_core.algorithms.policy_losses",
    "importance_weights": "relax_core.algorithms.policy_losses",
    "ppo_clip_loss": "relax_core.algorithms.policy_losses",
    "rejection_keep": "relax_core.algorithms.policy_losses",
    "sapo_loss": "relax_core.algorithms.policy_losses",
}
"""Name → module of the torch math, imported when a name is first used."""


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'relax_core' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


# configs: machinery
__all__ = [
    "ConfigError",
    "ConfigIssue",
    "ConfigModel",
    "apply_overrides",
    "config_error_from",
    "dump_config",
    "load_config",
    "parse_override",
    "read_yaml_mapping",
]
# configs: components and presets
__all__ += [
    "PRESET_NAMES",
    "AdvantageEstimator",
    "AlgorithmConfig",
    "DataFileSpec",
    "KLControlConfig",
    "KLEstimator",
    "LossAggMode",
    "OptimizerConfig",
    "PolicyLossName",
    "PresetName",
    "RowSchema",
    "StalenessConfig",
    "load_preset",
    "lr_multiplier",
]
# the algorithm table (one entry per advantage estimator; validation, presets and dispatch read it)
__all__ += [
    "ALGORITHMS",
    "AdvantageFn",
    "AlgorithmSpec",
    "EstimatorInputs",
    "algorithm_spec",
    "estimator_names",
    "off_policy_alternatives",
    "preset_names",
]
# masked reductions
__all__ += [
    "aggregate_loss",
    "aggregation_units",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
]
# advantage estimators
__all__ += [
    "AdvantageOutput",
    "VTraceOutput",
    "broadcast_to_tokens",
    "compute_advantages",
    "discounted_returns",
    "dynamic_sampling_keep",
    "gae_advantages",
    "gpg_advantages",
    "group_index",
    "grpo_advantages",
    "outcome_token_rewards",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "vtrace",
]
# policy losses and corrections
__all__ += [
    "POLICY_LOSSES",
    "ImportanceWeights",
    "Surrogate",
    "SurrogateInputs",
    "cispo_loss",
    "clip_cov_loss",
    "compute_policy_loss",
    "dppo_loss",
    "dro_loss",
    "geo_mean_loss",
    "gspo_log_ratio",
    "importance_weights",
    "kl_cov_loss",
    "pg_loss",
    "policy_loss_units",
    "ppo_clip_loss",
    "rejection_keep",
    "sapo_loss",
]
# value loss, KL, entropy, log-probs
__all__ += [
    "KLController",
    "entropy_from_logits",
    "kl_estimate",
    "kl_full",
    "kl_penalised_rewards",
    "token_logprobs",
    "value_loss",
]
# rewards
__all__ += [
    "REWARD_REGISTRY",
    "AsyncRewardFn",
    "BatchedRewardFn",
    "RewardFn",
    "exact_match_reward",
    "extract_boxed",
    "extract_choice",
    "format_reward",
    "math_reward",
    "multiple_choice_reward",
    "normalize_number",
    "resolve_reward_fn",
]
# rewards: more built-ins, user functions, routing runner, remote
__all__ += [
    "CallStyle",
    "RemoteReward",
    "RemoteRewardConfig",
    "RemoteRewardError",
    "RewardKind",
    "RewardOutcome",
    "RewardRequest",
    "RewardRunner",
    "RewardRunnerConfig",
    "RewardSpec",
    "RewardStats",
    "build_reward_runner",
    "call_style",
    "import_file",
    "length_penalty_reward",
    "load_reward_fn",
    "math_verify_reward",
    "parse_reward_value",
    "regex_reward",
    "weighted_reward",
]
