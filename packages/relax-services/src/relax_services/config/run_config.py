"""The run config of ``relax train``: relax-core's component configs plus one small config per service.

A run is one YAML file plus dotted overrides (``staleness.tau=1``); with no file, the defaults below are the
embedded default run (async GRPO, τ = 2, tiny omni model, synthetic omni task mix).

The section configs live by topic in private modules and are exported here: model and data (``_data_config``),
the services' sections (``_service_config``), run settings and faults (``_run_settings``); this module holds the
whole run's config, its embedded defaults and its loader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pydantic

from relax_core import (
    AlgorithmConfig,
    ConfigError,
    ConfigModel,
    OptimizerConfig,
    StalenessConfig,
    algorithm_spec,
    apply_overrides,
    load_config,
    off_policy_alternatives,
    preset_names,
    read_yaml_mapping,
)
from relax_core.config.presets import preset_data
from relax_services.config.data import DEFAULT_MODEL_SOURCE, DataConfig, LoraConfig, ModelConfig
from relax_services.config.data import DEFAULT_TASKS as DEFAULT_TASKS
from relax_services.config.data import TaskName as TaskName
from relax_services.config.metrics import MetricsConfig
from relax_services.config.reward import RunRewardConfig
from relax_services.config.run import ACTOR_TARGETS, FaultSpec, RunSettings
from relax_services.config.services import MICRO_BATCH_GROUPS_CAP as MICRO_BATCH_GROUPS_CAP
from relax_services.config.services import (
    CriticConfig,
    EvalConfig,
    HealthConfig,
    QueueSettings,
    ReferenceConfig,
    RolloutConfig,
    TrainerConfig,
    VLLMSettings,
)
from relax_services.config.sizes import queue_bytes_problem
from relax_services.config.trainer_group import check_trainer_group

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


RUN_DEFAULTS: dict[str, dict[str, Any]] = {
    "algorithm": {
        "preset": "grpo",
        "entropy_coef": 0.01,
        "kl_coef": 0.1,
        "kl_estimator": "full",
        "decoupled": True,
        "tis_cap": 2.0,
    },
    "optimizer": {
        "lr": 1e-3,
        "weight_decay": 0.0,
        "grad_clip": 1.0,
        # Constant: the text task is still learning late in the run, and a cosine decay to 0.1x slowed it (its
        # held-out reached 0.8 within 10 minutes in one of five runs; see docs/quickstart.md). A decaying schedule a run
        # gives spans the run (trainer.total_steps, load_run_config) unless it sets optimizer.total_steps.
        "schedule": "constant",
    },
    "staleness": {"tau": 2, "on_stale": "requeue"},
}
"""Where the embedded default run departs from relax-core's component defaults. A run config's own values are
merged over these key by key; an ``algorithm.preset`` of its own replaces the default algorithm block whole."""

OWN_CHECKPOINT_ALGORITHM: dict[str, Any] = {"kl_estimator": "k3"}
"""Where a run on a checkpoint of the user's own (``model.source`` not the tiny default) departs from the default
run's algorithm: the sampled-token KL estimate (k3, verl's ``low_var_kl``) that the field uses. The default run's
exact KL over the vocabulary (measured to matter there, see docs/quickstart.md) moves the Reference's whole next-token
distribution, ``[L, V]`` floats per sample, through the queue: 0.6 GB a row at V = 151,936 and L = 1,024. Set
``algorithm.kl_estimator=full`` to have it anyway."""


def _default_algorithm() -> AlgorithmConfig:
    return AlgorithmConfig.model_validate(RUN_DEFAULTS["algorithm"])


def _default_optimizer() -> OptimizerConfig:
    # Only used when a RunConfig is built with an optimizer section given by object; otherwise the before-validator
    # fills in the section with the run's length.
    return OptimizerConfig.model_validate({**RUN_DEFAULTS["optimizer"], "total_steps": 1000})


class RunConfig(ConfigModel):
    """A whole ``relax train`` run."""

    algorithm: AlgorithmConfig = pydantic.Field(default_factory=_default_algorithm)
    """The RL algorithm (preset plus overrides); see relax-core's presets."""

    optimizer: OptimizerConfig = pydantic.Field(default_factory=_default_optimizer)
    """Policy optimizer."""

    staleness: StalenessConfig = pydantic.Field(
        default_factory=lambda: StalenessConfig.model_validate(RUN_DEFAULTS["staleness"])
    )
    """The τ knob: 0 is strictly on-policy (equal to a synchronous trainer), null is fully asynchronous."""

    reward: RunRewardConfig = pydantic.Field(default_factory=RunRewardConfig)
    """Reward scoring responses against each prompt's ground truth (a registry name, a user function, routes
    by ``data_source``)."""

    model: ModelConfig = pydantic.Field(default_factory=ModelConfig)
    data: DataConfig = pydantic.Field(default_factory=DataConfig)
    rollout: RolloutConfig = pydantic.Field(default_factory=RolloutConfig)
    trainer: TrainerConfig = pydantic.Field(default_factory=TrainerConfig)
    queue: QueueSettings = pydantic.Field(default_factory=QueueSettings)
    reference: ReferenceConfig = pydantic.Field(default_factory=ReferenceConfig)
    critic: CriticConfig = pydantic.Field(default_factory=CriticConfig)
    eval: EvalConfig = pydantic.Field(default_factory=EvalConfig)
    health: HealthConfig = pydantic.Field(default_factory=HealthConfig)
    faults: list[FaultSpec] = pydantic.Field(default_factory=list)
    """Faults to inject (empty in normal runs)."""
    run: RunSettings = pydantic.Field(default_factory=RunSettings)
    metrics: MetricsConfig = pydantic.Field(default_factory=MetricsConfig)
    """Where metric records go: ``metrics.jsonl`` always, TensorBoard, W&B and MLflow on request."""

    @pydantic.model_validator(mode="before")
    @classmethod
    def _schedule_length(cls, data: object) -> object:
        return _derive_norm_constant(_derive_schedule_length(data)) if isinstance(data, dict) else data

    @pydantic.model_validator(mode="after")
    def _check_consistency(self) -> RunConfig:
        estimator = self.algorithm.advantage_estimator
        if algorithm_spec(estimator).on_policy_only and self.staleness.tau != 0:
            raise ValueError(
                f"algorithm.advantage_estimator={estimator!r} assumes on-policy data but staleness.tau="
                f"{self.staleness.tau}; use algorithm.advantage_estimator={off_policy_alternatives(estimator)} "
                "(off-policy corrected) or staleness.tau=0"
            )
        if algorithm_spec(estimator).needs_greedy_baseline and (self.rollout.env or self.rollout.agent):
            raise ValueError(
                f"algorithm.advantage_estimator={estimator!r} takes a greedy single-turn response's reward as each "
                "prompt's baseline; with rollout.env or rollout.agent an episode has no such response: use grpo, rloo, "
                "opo or gpg"
            )
        if self.trainer.groups_per_step % self.trainer.minibatches:
            raise ValueError(
                f"trainer.groups_per_step={self.trainer.groups_per_step} must be a multiple of "
                f"trainer.minibatches={self.trainer.minibatches}"
            )
        if self.trainer.micro_batch_groups > self.trainer.groups_per_step:
            raise ValueError(
                f"trainer.micro_batch_groups={self.trainer.micro_batch_groups} must be <= "
                f"trainer.groups_per_step={self.trainer.groups_per_step}"
            )
        if self.samples_per_step > self.queue.max_rows:
            # The trainer takes whole updates only: the sample queue must hold one at once, or producers block on
            # a full queue while the trainer waits for the rest of its update (a silent hang).
            raise ValueError(
                f"trainer.groups_per_step={self.trainer.groups_per_step} × algorithm.group_size="
                f"{self.algorithm.group_size} = {self.samples_per_step} samples per update do not fit in "
                f"queue.max_rows={self.queue.max_rows}; raise queue.max_rows or lower trainer.groups_per_step"
            )
        if (problem := queue_bytes_problem(self)) is not None:  # the byte bound's counterpart of the check above
            raise ValueError(problem)
        if self.trainer.groups_per_step % self.trainer.micro_batch_groups:
            raise ValueError(
                f"trainer.groups_per_step={self.trainer.groups_per_step} must be a multiple of "
                f"trainer.micro_batch_groups={self.trainer.micro_batch_groups}"
            )
        if self.rollout.autoscale.enabled and self.run.mode == "colocated":
            raise ValueError(
                "rollout.autoscale.enabled=true with run.mode=colocated: replicas are added and removed as processes "
                "of a distributed run; use run.mode=distributed or turn autoscaling off"
            )
        if self.rollout.vllm.lora_requests and (self.rollout.engine != "vllm" or self.model.lora is None):
            raise ValueError(
                "rollout.vllm.lora_requests=true publishes the policy's adapters for vLLM's LoRA requests: it needs "
                f"rollout.engine='vllm' (got {self.rollout.engine!r}) and model.lora "
                f"(got {'null' if self.model.lora is None else 'set'})"
            )
        check_trainer_group(self)
        self._check_fault_targets()
        return self

    def _check_fault_targets(self) -> None:
        """A fault must hit something the run has: the critic and its weight store exist only for an estimator
        with a critic, the Reference only with a KL term or an estimator that needs it."""
        algo = self.algorithm
        absent = {
            "critic": None if algo.uses_critic else f"algorithm.advantage_estimator={algo.advantage_estimator!r}",
            "critic_weights": None
            if algo.uses_critic
            else f"algorithm.advantage_estimator={algo.advantage_estimator!r}",
            "reference": None
            if algo.uses_reference
            else f"algorithm.kl_coef={algo.kl_coef} with algorithm.advantage_estimator={algo.advantage_estimator!r}",
        }
        for i, fault in enumerate(self.faults):
            if (why := absent.get(fault.service)) is not None:
                raise ValueError(f"faults[{i}].service={fault.service!r}: this run has none ({why})")
            if fault.replica is not None and fault.replica >= self.rollout.replicas:
                raise ValueError(
                    f"faults[{i}].replica={fault.replica}: this run starts rollout.replicas={self.rollout.replicas} "
                    f"(rollout-0 .. rollout-{self.rollout.replicas - 1})"
                )

    @property
    def samples_per_step(self) -> int:
        """Samples one update consumes: groups × group size."""
        return self.trainer.groups_per_step * self.algorithm.group_size

    @property
    def rollout_call_groups(self) -> int:
        """Groups one Rollout call takes: the largest divisor of ``trainer.groups_per_step`` that is at most
        ``rollout.groups_per_call``. Admission grants whole updates' worth of groups, so a call size that does not
        divide an update would wait for groups that are never admitted (at τ = 0, or with a small update)."""
        step, cap = self.trainer.groups_per_step, self.rollout.groups_per_call
        return max(n for n in range(1, min(step, cap) + 1) if step % n == 0)


def _read_source(source: str | Path | dict[str, object] | None) -> dict[str, object]:
    if source is None:
        return {}
    return dict(source) if isinstance(source, dict) else read_yaml_mapping(Path(source))


def _derive_schedule_length(data: dict[str, object]) -> dict[str, object]:
    """One source of truth for the run length: ``optimizer.total_steps`` (the LR schedule's length) is
    ``trainer.total_steps`` unless the config sets it."""
    data = dict(data)
    optimizer = data.get("optimizer")
    if isinstance(optimizer, OptimizerConfig) or (isinstance(optimizer, dict) and optimizer.get("total_steps")):
        return data
    trainer = data.get("trainer")
    steps = trainer.get("total_steps") if isinstance(trainer, dict) else None
    if not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1):
        steps = TrainerConfig.model_fields["total_steps"].default  # an invalid value is reported under trainer.
    if optimizer is None:
        data["optimizer"] = {**RUN_DEFAULTS["optimizer"], "total_steps": steps}
    elif isinstance(optimizer, dict):
        data["optimizer"] = {**optimizer, "total_steps": steps}
    return data


def _derive_norm_constant(data: dict[str, object]) -> dict[str, object]:
    """One source of truth for Dr.GRPO's constant: ``seq-mean-token-sum-norm`` divides token sums by
    ``algorithm.loss_norm_constant``, which is the generation budget ``rollout.max_new_tokens`` unless the config
    sets it, never the padded width of the batch at hand (that moves with each batch's longest answer)."""
    algo, rollout = data.get("algorithm"), data.get("rollout")
    budget = rollout.get("max_new_tokens") if isinstance(rollout, dict) else getattr(rollout, "max_new_tokens", None)
    if rollout is None:
        budget = RolloutConfig.model_fields["max_new_tokens"].default
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        return data  # an invalid value is reported under rollout.
    if isinstance(algo, AlgorithmConfig):
        if algo.loss_agg_mode == "seq-mean-token-sum-norm" and algo.loss_norm_constant is None:
            data = {**data, "algorithm": algo.model_copy(update={"loss_norm_constant": budget})}
        return data
    given = algo if isinstance(algo, dict) else {} if algo is None else None
    if given is None or given.get("loss_norm_constant") is not None:
        return data
    preset = given.get("preset")
    preset_values = preset_data(preset) if isinstance(preset, str) and preset in preset_names() else {}
    mode = given.get("loss_agg_mode", preset_values.get("loss_agg_mode"))
    if mode == "seq-mean-token-sum-norm":
        data = {**data, "algorithm": {**given, "loss_norm_constant": budget}}
    return data


def load_run_config(
    source: str | Path | dict[str, object] | None = None, overrides: list[str] | None = None
) -> RunConfig:
    """Load a run config from YAML (or nothing: the embedded default) plus dotted overrides.

    The embedded defaults (:data:`RUN_DEFAULTS`, with :data:`OWN_CHECKPOINT_ALGORITHM` over them for a checkpoint
    of the user's own) stay in force for every key the file and overrides leave unset.

    Raises:
        ConfigError: naming each offending dotted field, its value and what is allowed.
    """
    data = apply_overrides(_read_source(source), overrides or [])
    model = data.get("model")
    own_checkpoint = isinstance(model, dict) and str(model.get("source", DEFAULT_MODEL_SOURCE)) != DEFAULT_MODEL_SOURCE
    for section, defaults in RUN_DEFAULTS.items():
        if section == "algorithm" and own_checkpoint:
            defaults = {**defaults, **OWN_CHECKPOINT_ALGORITHM}
        given = data.get(section)
        if given is None:
            data[section] = dict(defaults)
        elif isinstance(given, dict) and not (section == "algorithm" and "preset" in given):
            data[section] = {**defaults, **given}
    try:
        return load_config(RunConfig, data)
    except ConfigError as exc:  # name the file the bad value came from
        raise ConfigError(exc.issues, str(source) if isinstance(source, str | Path) else None) from None
