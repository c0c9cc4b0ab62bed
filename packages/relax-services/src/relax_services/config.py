"""The run config of ``relax train``: relax-core's component configs plus one small config per service.

A run is one YAML file plus dotted overrides (``staleness.tau=1``); with no file, the defaults below are the
embedded default run (async GRPO, τ = 2, tiny omni model, synthetic omni task mix).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import pydantic

from relax_core import (
    AlgorithmConfig,
    ConfigError,
    ConfigModel,
    DataFileSpec,
    OptimizerConfig,
    RowSchema,
    StalenessConfig,
    algorithm_spec,
    apply_overrides,
    load_config,
    off_policy_alternatives,
    read_yaml_mapping,
)
from relax_services._hosts_config import DEFAULT_HOSTS, check_hosts, check_hosts_placement
from relax_services._reward_config import RunRewardConfig
from relax_services._sizes import queue_bytes_problem
from relax_services._trainer_group_config import check_trainer_group, default_train_engine

__all__ = [
    "ACTOR_TARGETS",
    "DataConfig",
    "EvalConfig",
    "FaultSpec",
    "HealthConfig",
    "ModelConfig",
    "QueueSettings",
    "RolloutConfig",
    "RunConfig",
    "RunRewardConfig",
    "RunSettings",
    "TrainerConfig",
    "VLLMSettings",
    "load_run_config",
]

MICRO_BATCH_GROUPS_CAP = 32
"""Most groups in one micro-batch when ``trainer.micro_batch_groups`` is not given."""

TaskName = Literal["image", "audio", "video", "text", "audio_video"]
DEFAULT_TASKS: tuple[TaskName, ...] = ("image", "audio", "video", "text")


class ModelConfig(ConfigModel):
    """Which policy model to train."""

    source: str = "tiny-omni"
    """A local Hugging Face checkpoint folder (config.json, weights, tokenizer with its chat template, optional
    preprocessor_config.json) of a supported family (``relax_services.models.FAMILIES``). 'tiny-omni' is the
    default ≈0.4 M-parameter Qwen2.5-Omni thinker: a folder written once under ``$RELAX_CACHE_DIR`` (default
    ``~/.cache/relax``) from a config and a locally built tokenizer, then read like any other."""

    seed: int = 0
    """Seed of the initial weights of the 'tiny-omni' folder (ignored for other sources)."""

    export_hf: bool = True
    """Also write each checkpoint's policy (and critic) in Hugging Face format, in its ``hf`` folder (weights as
    safetensors, plus the model folder's tokenizer and processor files); ``relax export`` does it afterwards."""


class DataConfig(ConfigModel):
    """The training data: the user's dataset files (``train_files``), or by default the synthetic omni tasks,
    written as dataset files of the same schema (one per task, weighted evenly) and read the same way."""

    # `schema` is the YAML name of `schema_` (pydantic's BaseModel has a `schema` attribute of its own).
    model_config = pydantic.ConfigDict(validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)

    train_files: list[DataFileSpec] = pydantic.Field(default_factory=list)
    """Dataset files to train on (JSONL, Parquet or a ``datasets`` folder in verl's RL schema, see ``schema``),
    each a path or ``{path, weight, format}``; ``data.train_files=a.parquet`` on the command line. Empty: the
    synthetic tasks below. Streamed endlessly, each file reshuffled every pass."""

    eval_files: list[DataFileSpec] = pydantic.Field(default_factory=list)
    """Held-out files (same forms), evaluated greedily per ``data_source``; empty with ``train_files`` given:
    no held-out evaluation."""

    schema_: RowSchema = pydantic.Field(default_factory=RowSchema, alias="schema")
    """Column names and row rules of the dataset files (``data.schema.prompt_key=question``, ...)."""

    shuffle_buffer: int = pydantic.Field(default=1024, ge=0)
    """Rows held for shuffling the training files (0 or 1: file order)."""

    tasks: list[TaskName] = pydantic.Field(default_factory=lambda: list(DEFAULT_TASKS))
    """Tasks to train on; each is one modality path (audio_video combines two)."""

    train_per_task: int = pydantic.Field(default=256, ge=1)
    """Training prompts written per task."""

    eval_per_task: int = pydantic.Field(default=32, ge=1)
    """Held-out prompts per task, never trained on."""

    difficulty: int = pydantic.Field(default=0, ge=0)
    """Task difficulty level passed to the synthetic task generator."""

    seed: int = 0
    """Seed of the synthetic data and of the prompt order (the dataset files' mixing and shuffling too)."""

    @pydantic.field_validator("train_files", "eval_files", mode="before")
    @classmethod
    def _paths_as_specs(cls, value: object) -> object:
        """A path, or a list of paths and ``{path, weight, format}`` mappings (what an override gives)."""
        if isinstance(value, str | Path):
            value = [value]
        if isinstance(value, list):
            return [{"path": str(v)} if isinstance(v, str | Path) else v for v in value]
        return value

    adaptive_weights: bool = True
    """Weigh each training file by max(1 − the latest held-out reward of its rows' data_source, 0) +
    ``adaptive_floor``, so lagging tasks get more prompts (the files' own weights when off)."""

    adaptive_floor: float = pydantic.Field(default=0.03, gt=0.0, le=1.0)
    """A solved task's weight under ``adaptive_weights`` (every task's weight is offset by it). Lower gives a
    lagging task a larger share once the others are solved, at the cost of fewer prompts rehearsing them: with
    three solved tasks and one at 0.5, 0.1 gives the lagging one 67 % of the prompts, 0.03 gives it 85 %."""

    data_dir: Path | None = None
    """An existing folder where the synthetic tasks' dataset files (one training and one held-out JSONL per task,
    media beside them) are written once and reused. Default: ``$RELAX_CACHE_DIR/datasets`` (the default model's
    cache, ``~/.cache/relax``)."""


class VLLMSettings(ConfigModel):
    """``rollout.engine=vllm``: the vLLM engine each Rollout worker (and the Evaluator) builds (extra
    ``relax-services[vllm]``; see ``relax_services.engines.vllm_rollout``)."""

    tensor_parallel_size: int = pydantic.Field(default=1, ge=1)
    """Tensor-parallel ranks of each replica (one replica per Rollout worker)."""

    dtype: str = "float32"
    """Weight and activation dtype of vLLM (``float32`` matches the trainer's default forward)."""

    max_model_len: int = pydantic.Field(default=2048, ge=1)
    """Longest prompt + response, in tokens."""

    max_num_seqs: int = pydantic.Field(default=256, ge=1)
    """Requests vLLM schedules at once."""

    kv_cache_mib: int = pydantic.Field(default=256, ge=1)
    """KV-cache size per replica, in MiB."""

    logprobs_mode: Literal["auto", "processed_logprobs", "raw_logits"] = "auto"
    """How behaviour log-probs are read from vLLM: ``processed_logprobs`` (sampled token only; needs top_p = 1),
    ``raw_logits`` (whole logit rows; any top-p), ``auto``: the first unless ``rollout.top_p < 1``."""

    in_process: bool = True
    """Run vLLM's engine core in the worker's own process (weights stream to it without a staging file)."""


class RolloutConfig(ConfigModel):
    """The Rollout service: generation engine and sampling parameters."""

    num_workers: int = pydantic.Field(default=1, ge=1)
    """Rollout actors (each its own process)."""

    groups_per_call: int = pydantic.Field(default=16, ge=1)
    """Most prompt groups generated together in one batched engine call (see ``RunConfig.rollout_call_groups``)."""

    temperature: float = pydantic.Field(default=1.0, gt=0.0)
    """Sampling temperature."""

    top_p: float = pydantic.Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass (1.0 samples the full vocabulary)."""

    max_new_tokens: int = pydantic.Field(default=4, ge=1)
    """Longest response in tokens (answers are 1–3 characters plus end-of-answer)."""

    engine: str = "hf"
    """Rollout engine: an id of ``relax_services.engines.registry.ROLLOUT_ENGINES`` (``hf``: transformers,
    ``vllm``: vLLM, extra ``relax-services[vllm]``)."""

    vllm: VLLMSettings = pydantic.Field(default_factory=VLLMSettings)
    """Settings of the vLLM engine (used with ``engine=vllm``)."""

    partial_rollout: Literal["finish_old", "switch", "abort_resume"] = "switch"
    """What generation in flight does when new weights arrive: finish on the old weights, switch weights
    between decode steps (per-token versions recorded), or abort and restart on the new weights."""


class TrainerConfig(ConfigModel):
    """The Trainer service: what one update consumes and how long the run lasts."""

    engine: str = "torch"
    """Training engine: an id of ``relax_services.engines.registry.TRAIN_ENGINES`` (``torch``: single process;
    ``fsdp``: a group of ``world_size`` ranks on torch FSDP2). When not given: ``fsdp`` if ``world_size`` > 1."""

    world_size: int = pydantic.Field(default=1, ge=1)
    """Ranks of the Trainer (Ray actors forming one process group, FSDP2-sharded; 1: one process). Every rank
    trains on an equal share of each minibatch, so ``groups_per_step / minibatches × algorithm.group_size``
    must be a multiple of it (whole groups per rank when ``groups_per_step / minibatches`` is); with
    ``algorithm.filter_groups``, ``algorithm.group_size`` must be (any number of kept groups then splits
    evenly). ``micro_batch_groups`` bounds each rank's micro-batch."""

    tensor_parallel: int = pydantic.Field(default=1, ge=1)
    """Tensor-parallel degree of a Trainer group (``trainer.engine=fsdp``): each decoder block's attention and MLP
    split over this many ranks (it must divide ``world_size``, and the model's attention heads, key/value heads and
    MLP width); the group is ``world_size / tensor_parallel`` data-parallel ranks of ``tensor_parallel`` each."""

    groups_per_step: int = pydantic.Field(default=32, ge=1)
    """Prompt groups per optimizer update (samples per update = groups_per_step × algorithm.group_size)."""

    micro_batch_groups: int = pydantic.Field(default=32, ge=1)
    """Groups per forward/backward micro-batch (gradient accumulation when smaller than groups_per_step). When
    not given: the largest divisor of groups_per_step that is at most 32, so ``trainer.groups_per_step=4`` alone
    is a valid run."""

    minibatches: int = pydantic.Field(default=1, ge=1)
    """Optimizer steps per update, each on an equal slice of whole groups (PPO minibatches). With more than one,
    the proximal log-probs of decoupled PPO are computed once, before the first."""

    ppo_epochs: int = pydantic.Field(default=1, ge=1)
    """Passes over the minibatches per update."""

    total_steps: int = pydantic.Field(default=1000, ge=1)
    """Stop after this many updates."""

    max_minutes: float | None = pydantic.Field(default=8.0, gt=0.0)
    """Stop after this much wall-clock time (None: no limit)."""

    target_reward: float | None = pydantic.Field(default=0.9, gt=0.0, le=1.0)
    """Stop early once the held-out reward of every task reaches this (None: never stop early)."""

    checkpoint_every: int = pydantic.Field(default=50, ge=1)
    """Write a checkpoint every this many updates (and at the end)."""

    checkpoint_every_s: float | None = pydantic.Field(default=120.0, gt=0.0)
    """Also write one when this many seconds passed since the last with at least one new update (None: by
    updates only). A Trainer failure goes back to the last checkpoint, so it costs at most ``checkpoint_every``
    updates and about this much time of work."""

    keep_checkpoints: int = pydantic.Field(default=2, ge=1)
    """How many most recent checkpoints to keep."""

    warmup_format_steps: int = pydantic.Field(default=30, ge=0)
    """Supervised steps that teach the answer format only (an option of the task, never the answer). Keep it short:
    a long warm-up also teaches that the answer does not depend on the input (measured: 50 steps left a text-only
    probe at chance for ~150 RL updates, 10 steps let it reach 0.94 held-out by update 260)."""

    warmup_lr: float = pydantic.Field(default=2e-3, gt=0.0)
    """Learning rate of the format warm-up."""

    seed: int = 0
    """Seed of the trainer RNG (sampling seeds derive from it and the prompt key)."""

    weight_sync: Literal["object_store", "broadcast"] = "object_store"
    """How new weights reach the rollout workers: ``object_store`` (each version put once in Ray's object store,
    every reader fetches it) or ``broadcast`` (also broadcast bucket by bucket over a torch.distributed group of
    the Trainer and the rollout workers, gloo on CPU and NCCL on GPU; a worker outside the group, just restarted or
    after a broken broadcast, reads the object store until it joins at the next version). Not with
    ``run.mode=colocated``."""

    sync_bucket_mib: float = pydantic.Field(default=256.0, gt=0.0)
    """Bucket size of the broadcast, MiB (a larger tensor travels alone in its own bucket)."""

    @pydantic.model_validator(mode="before")
    @classmethod
    def _default_micro_batch(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("micro_batch_groups") is None:
            step = data.get("groups_per_step", cls.model_fields["groups_per_step"].default)
            if isinstance(step, int) and not isinstance(step, bool) and step >= 1:
                cap = MICRO_BATCH_GROUPS_CAP
                data = {**data, "micro_batch_groups": max(n for n in range(1, min(step, cap) + 1) if step % n == 0)}
        return data

    @pydantic.model_validator(mode="before")
    @classmethod
    def _default_engine(cls, data: object) -> object:
        return default_train_engine(data)


class QueueSettings(ConfigModel):
    """The TransferQueue between services."""

    max_rows: int = pydantic.Field(default=4096, ge=1)
    """Capacity in rows; producers block when it is reached."""

    max_bytes: int = pydantic.Field(default=512 * 1024 * 1024, ge=1)
    """Capacity in bytes of payload."""

    lease_timeout_s: float = pydantic.Field(default=60.0, gt=0.0)
    """A leased batch not acked within this time is redelivered."""


class EvalConfig(ConfigModel):
    """Held-out evaluation (greedy decoding, its own process)."""

    every_steps: int = pydantic.Field(default=10, ge=1)
    """Evaluate the newest weights after every this many updates."""


class HealthConfig(ConfigModel):
    """Heartbeats and restarts."""

    heartbeat_timeout_s: float = pydantic.Field(default=30.0, gt=0.0)
    """A service whose progress counter has not moved for this long is declared hung."""

    max_restarts: int = pydantic.Field(default=3, ge=0)
    """In-place restarts per service before a global restart from the last checkpoint."""

    restart_backoff_s: float = pydantic.Field(default=1.0, ge=0.0)
    """First restart delay; doubles with every restart of the same service."""

    max_global_restarts: int = pydantic.Field(default=2, ge=0)
    """Restarts of the whole run from its last checkpoint (after a Trainer failure, or a service that kept
    failing) before the run stops with an error."""


ACTOR_TARGETS = ("prompt_queue", "sample_queue", "weights", "critic_weights", "health_monitor")
"""The actors of a pipeline that are not services (no work loop, no heartbeat) and that faults can kill: the two
queues, the policy and critic weight stores, and the health monitor."""


class FaultSpec(ConfigModel):
    """One injected fault (for tests and ``relax chaos``)."""

    service: Literal[
        "rollout",
        "reward",
        "reference",
        "critic",
        "trainer",
        "prompt_queue",
        "sample_queue",
        "weights",
        "critic_weights",
        "health_monitor",
    ]
    """Which service, or which of the pipeline's other actors (:data:`ACTOR_TARGETS`: a queue, a weight store, the
    health monitor), to hit."""

    kind: Literal["kill", "raise", "hang", "kill_rank"] = "kill"
    """SIGKILL its process, raise inside its work loop, or hang its work loop; ``kill_rank`` (the Trainer with
    ``trainer.world_size`` > 1): the last rank's process dies inside the next update. An actor target has no work
    loop: ``kill`` only."""

    at_step: int = pydantic.Field(default=5, ge=0)
    """Inject once the trainer has reached this version."""

    min_trainer_backlog: int = pydantic.Field(default=0, ge=0)
    """And only once at least this many complete sample rows (every field the trainer reads present) wait for the
    trainer (e.g. a whole update's worth, so that the outage of a producer overlaps work the trainer can still
    consume); 0: no condition."""

    during_restart: bool = False
    """Inject during the first global restart that begins once the trainer has reached ``at_step``: right after
    the new pipeline's queues are restored from the checkpoint and its stores exist, before its services start
    (where Ray's memory monitor once killed the queue actors). An actor target only."""

    @pydantic.model_validator(mode="after")
    def _actor_faults(self) -> FaultSpec:
        actor = self.service in ACTOR_TARGETS
        if actor and self.kind != "kill":
            raise ValueError(
                f"fault on {self.service}: an actor without a work loop can only be killed (kind=kill), "
                f"got kind={self.kind}"
            )
        if self.during_restart and not actor:
            raise ValueError(
                f"fault on {self.service}: during_restart applies to {', '.join(ACTOR_TARGETS)} only "
                "(a global restart starts the services after it)"
            )
        return self


class RunSettings(ConfigModel):
    """Where the run writes and how it shows progress."""

    output_dir: Path = Path("runs")
    """Parent folder of run folders."""

    name: str | None = None
    """Run folder name (default: a timestamp)."""

    ray_address: str | None = None
    """Join an existing Ray cluster at this address instead of starting a local one."""

    mode: Literal["distributed", "colocated"] = "distributed"
    """'distributed': one Ray actor per service (several processes, GPUs, nodes). 'colocated': every service as a
    thread of the ``relax train`` process over the in-process queue and weight store (one machine, no Ray)."""

    progress: Literal["auto", "live", "lines", "none"] = "auto"
    """'live' redraws a table (TTY), 'lines' prints one line per report, 'auto' picks by TTY."""

    report_every_s: float = pydantic.Field(default=5.0, gt=0.0)
    """Seconds between progress reports."""

    placement: dict[str, str] = pydantic.Field(default_factory=dict)
    """Pin roles to nodes: role (trainer, rollout, reward, reference, eval) → a Ray custom resource that only the
    chosen nodes have (each actor of the role requires 0.01 of it). Empty: Ray places actors freely."""

    hosts: list[list[str]] = pydantic.Field(default_factory=lambda: [list(host) for host in DEFAULT_HOSTS])
    """Distributed mode: roles whose services share one process (each list, two roles or more, is one Ray actor
    that runs them as threads over the same queue and weight-store clients; roles not listed have a process each,
    ``[]`` gives every service its own). A role stands for all its services (every Rollout worker). An exception in
    one role restarts that role inside its host; the death of the host restarts every role it held (a global
    restart when the Trainer is one of them). Default: the Reference, the Evaluator and the Reward in the Rollout's
    process. The colocated mode runs every role in its one process whatever this says."""

    @pydantic.field_validator("hosts")
    @classmethod
    def _check_hosts(cls, value: list[list[str]]) -> list[list[str]]:
        return check_hosts(value)

    @pydantic.model_validator(mode="after")
    def _hosts_on_one_node(self) -> RunSettings:
        check_hosts_placement(self.hosts, self.placement)
        return self


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
        # held-out reached 0.8 within 10 minutes in one of five runs; see the README). A decaying schedule a run
        # gives spans the run (trainer.total_steps, load_run_config) unless it sets optimizer.total_steps.
        "schedule": "constant",
    },
    "staleness": {"tau": 2, "on_stale": "requeue"},
}
"""Where the embedded default run departs from relax-core's component defaults. A run config's own values are
merged over these key by key; an ``algorithm.preset`` of its own replaces the default algorithm block whole."""


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
    eval: EvalConfig = pydantic.Field(default_factory=EvalConfig)
    health: HealthConfig = pydantic.Field(default_factory=HealthConfig)
    faults: list[FaultSpec] = pydantic.Field(default_factory=list)
    """Faults to inject (empty in normal runs)."""
    run: RunSettings = pydantic.Field(default_factory=RunSettings)

    @pydantic.model_validator(mode="before")
    @classmethod
    def _schedule_length(cls, data: object) -> object:
        return _derive_schedule_length(data) if isinstance(data, dict) else data

    @pydantic.model_validator(mode="after")
    def _check_consistency(self) -> RunConfig:
        estimator = self.algorithm.advantage_estimator
        if algorithm_spec(estimator).on_policy_only and self.staleness.tau != 0:
            raise ValueError(
                f"algorithm.advantage_estimator={estimator!r} assumes on-policy data but staleness.tau="
                f"{self.staleness.tau}; use algorithm.advantage_estimator={off_policy_alternatives(estimator)} "
                "(off-policy corrected) or staleness.tau=0"
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


def load_run_config(
    source: str | Path | dict[str, object] | None = None, overrides: list[str] | None = None
) -> RunConfig:
    """Load a run config from YAML (or nothing: the embedded default) plus dotted overrides.

    The embedded defaults (:data:`RUN_DEFAULTS`) stay in force for every key the file and overrides leave unset.

    Raises:
        ConfigError: naming each offending dotted field, its value and what is allowed.
    """
    data = apply_overrides(_read_source(source), overrides or [])
    for section, defaults in RUN_DEFAULTS.items():
        given = data.get(section)
        if given is None:
            data[section] = dict(defaults)
        elif isinstance(given, dict) and not (section == "algorithm" and "preset" in given):
            data[section] = {**defaults, **given}
    try:
        return load_config(RunConfig, data)
    except ConfigError as exc:  # name the file the bad value came from
        raise ConfigError(exc.issues, str(source) if isinstance(source, str | Path) else None) from None
