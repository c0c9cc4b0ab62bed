"""The run config's service sections: the Rollout (with its vLLM engine settings), the Trainer, the queues
between services, the Evaluator, and the health checks that restart them. Exported by :mod:`relax_services.config`."""

from __future__ import annotations

from typing import Literal

import pydantic

from relax_core import ConfigModel
from relax_services.config.devices import Dtype, GpuCount
from relax_services.config.reward import absolute_file_spec
from relax_services.config.trainer_group import default_train_engine

__all__ = [
    "MAX_REPLICAS",
    "MICRO_BATCH_GROUPS_CAP",
    "AutoscaleConfig",
    "CriticConfig",
    "EvalConfig",
    "FSDPSettings",
    "HealthConfig",
    "QueueSettings",
    "ReferenceConfig",
    "RolloutConfig",
    "TrainerConfig",
    "VLLMSettings",
]

MICRO_BATCH_GROUPS_CAP = 32
"""Most groups in one micro-batch when ``trainer.micro_batch_groups`` is not given."""


class VLLMSettings(ConfigModel):
    """``rollout.engine=vllm``: the vLLM engine each Rollout worker (and the Evaluator) builds (extra
    ``relax-services[vllm]``; see ``relax_services.engines.vllm.rollout``)."""

    tensor_parallel_size: int | None = pydantic.Field(default=None, ge=1)
    """Tensor-parallel ranks of each replica (one replica per Rollout worker). None: ``rollout.gpus`` on a GPU run
    (a replica spans the GPUs its worker reserves), 1 on the CPU."""

    dtype: Dtype = "auto"
    """Weight and activation dtype of vLLM; ``auto``: ``rollout.dtype``'s (bfloat16 on GPU, float32 on the CPU,
    where float32 matches the trainer's forward)."""

    gpu_memory_utilization: float = pydantic.Field(default=0.85, gt=0.0, le=1.0)
    """Share of each GPU's memory vLLM may take for weights, activations and KV cache (GPU runs; on the CPU the KV
    cache is ``kv_cache_mib``). Lower it when another role shares the GPU (fractional ``rollout.gpus``)."""

    enforce_eager: bool | None = None
    """Run the model eagerly (no CUDA graphs): slower decoding, faster start and less memory. None: eager on the
    CPU, CUDA graphs on GPU."""

    enable_prefix_caching: bool = True
    """Reuse the KV cache of a prompt shared by the samples of a group (GPU runs)."""

    sleep_when_idle: bool = False
    """One GPU shared with the Trainer: between generate calls vLLM sleeps (its KV cache freed, its weights in host
    memory) and wakes for the next call or weight update, so the Trainer has the GPU's memory while it updates
    (vLLM's sleep mode; GPU runs only)."""

    max_model_len: int = pydantic.Field(default=2048, ge=1)
    """Longest prompt + response, in tokens."""

    max_num_seqs: int = pydantic.Field(default=256, ge=1)
    """Requests vLLM schedules at once."""

    kv_cache_mib: int = pydantic.Field(default=256, ge=1)
    """KV-cache size per replica, in MiB, on the CPU (a GPU run sizes it by ``gpu_memory_utilization``)."""

    logprobs_mode: Literal["auto", "processed_logprobs", "raw_logits"] = "auto"
    """How behaviour log-probs are read from vLLM: ``processed_logprobs`` (sampled token only; needs top_p = 1),
    ``raw_logits`` (whole logit rows; any top-p), ``auto``: the first unless ``rollout.top_p < 1``."""

    lora_requests: bool = False
    """With ``model.lora``: the Trainer publishes each version as its adapters alone (A and B of each target layer)
    and vLLM, which loads the base checkpoint once, serves them as LoRA requests (a peft folder per version, only the
    newest loaded). False: every version is the whole policy with the adapters merged in, as for every other
    engine. Needs ``rollout.engine=vllm`` (the Evaluator then runs vLLM too: every reader serves adapters)."""

    in_process: bool = True
    """Run vLLM's engine core in the worker's own process (weights stream to it without a staging file). vLLM keeps
    one engine core's state per process: a second engine in the same process (the Evaluator's beside the Rollout's
    in the default host) runs its engine core in a process of its own."""


MAX_REPLICAS = 64
"""Most Rollout replicas a run may have at once (the broadcast weight group's slots are ``0 .. MAX_REPLICAS - 1``)."""


class AutoscaleConfig(ConfigModel):
    """``rollout.autoscale``: the controller adds or removes Rollout replicas from what the Trainer and the replicas
    report (``relax_services.control.autoscale.Autoscaler``; docs/scaling.md). Over the last ``window`` updates:
    while the Trainer waited for samples more than ``up_wait_frac`` of its time, one replica is added (up to
    ``max``); else while the replicas were blocked (a full sample queue, or no admitted prompt to take: τ holds them
    back) more than ``down_block_frac`` of their time, one is removed (down to ``min``). After each change the
    window starts empty and no change follows for ``cooldown_s`` seconds. Not in colocated mode."""

    enabled: bool = False
    """Scale the replicas automatically (off: only ``rollout.replicas`` and ``relax scale`` set the count)."""

    min: int = pydantic.Field(default=1, ge=1, le=MAX_REPLICAS)
    """Fewest replicas autoscaling leaves."""

    max: int = pydantic.Field(default=4, ge=1, le=MAX_REPLICAS)
    """Most replicas autoscaling starts."""

    window: int = pydantic.Field(default=8, ge=1)
    """Updates whose waits one decision reads (a full window is needed; it restarts after each change)."""

    up_wait_frac: float = pydantic.Field(default=0.3, gt=0.0, lt=1.0)
    """Share of the Trainer's time spent waiting for samples above which a replica is added."""

    down_block_frac: float = pydantic.Field(default=0.5, gt=0.0, lt=1.0)
    """Share of the replicas' time spent blocked above which a replica is removed."""

    cooldown_s: float = pydantic.Field(default=30.0, ge=0.0)
    """Seconds after a change (or the run's start) before the next one."""

    @pydantic.model_validator(mode="after")
    def _bounds(self) -> AutoscaleConfig:
        if self.min > self.max:
            raise ValueError(f"rollout.autoscale.min ({self.min}) is above rollout.autoscale.max ({self.max})")
        return self


class RolloutConfig(ConfigModel):
    """The Rollout service: generation engine and sampling parameters."""

    replicas: int = pydantic.Field(default=1, ge=1, le=MAX_REPLICAS)
    """Rollout replicas at the start of the run: Rollout workers named ``rollout-0``, ``rollout-1``, ..., each in a
    process of its own (``run.hosts`` may put the first one beside other roles, never two replicas together), all
    pulling prompts from the one prompt queue. ``num_workers``, the field's earlier name, is still accepted.
    ``relax scale RUN_DIR rollout=N`` changes the count of a running run (docs/scaling.md)."""

    autoscale: AutoscaleConfig = pydantic.Field(default_factory=AutoscaleConfig)
    """Automatic scaling of the replicas between ``autoscale.min`` and ``autoscale.max`` (off by default)."""

    gpus: GpuCount = 1.0
    """GPUs of each Rollout worker on a GPU run (``run.device``): a fraction shares a device with other roles, a
    whole number above one is the vLLM replica's tensor-parallel size."""

    dtype: Dtype = "auto"
    """Dtype of the rollout engine's weights; ``auto``: bfloat16 on GPU, float32 on the CPU."""

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

    env: str | None = None
    """A multi-turn environment: ``path/to/file.py:Class`` (relative to the working directory of ``relax train``)
    or ``module:Class``; one instance per episode, its typed, documented public methods the model's tools (see
    docs/multi-turn.md). None: single-turn completions."""

    agent: str | None = None
    """A black-box agent: ``path/to/file.py:function`` or ``module:function`` naming ``async def run(task,
    client)``, called once per episode with the prompt row's item and an ``openai.AsyncOpenAI`` client of a local
    chat-completions endpoint the Rollout serves (extra ``relax-services[agent]``); it returns the episode's reward
    or None for ``reward.fn``. The ``env`` bounds below apply to it too. None: no agent (exclusive with ``env``)."""

    max_turns: int = pydantic.Field(default=4, ge=1)
    """Assistant turns of one episode at most (with ``env``); ``max_new_tokens`` bounds each of them."""

    max_episode_tokens: int = pydantic.Field(default=1024, ge=1)
    """Response tokens of one episode at most, assistant and environment tokens together (with ``env``)."""

    max_tool_output_tokens: int = pydantic.Field(default=256, ge=8)
    """Tokens of one tool result or environment message at most; a longer one is cut in the middle, the cut
    marked with its size (with ``env``)."""

    tool_timeout_s: float = pydantic.Field(default=30.0, gt=0.0)
    """Seconds one tool call may take; past it the model sees an error message and the call is counted."""

    env_timeout_s: float = pydantic.Field(default=60.0, gt=0.0)
    """Seconds one call of the environment's ``reset``, ``step``, ``reward`` or ``close`` may take; past it the
    episode has failed (``env_failure``)."""

    episode_timeout_s: float = pydantic.Field(default=600.0, gt=0.0)
    """Seconds of one episode at most, generation included; past it the episode has failed (``env_failure``)."""

    env_failure: Literal["zero", "requeue"] = "zero"
    """What an episode whose environment raised or hung becomes: scored 0 (``zero``) or generated again
    (``requeue``); either way it is counted."""

    @pydantic.model_validator(mode="before")
    @classmethod
    def _earlier_name(cls, data: object) -> object:
        """``rollout.num_workers`` (the earlier name of ``replicas``) keeps older configs valid."""
        if isinstance(data, dict) and "num_workers" in data:
            if "replicas" in data:
                raise ValueError(
                    f"rollout.num_workers ({data['num_workers']!r}) and rollout.replicas ({data['replicas']!r}) are "
                    "one field (num_workers is its earlier name): give only rollout.replicas"
                )
            data = {("replicas" if k == "num_workers" else k): v for k, v in data.items()}
        return data

    @pydantic.field_validator("env", "agent")
    @classmethod
    def _absolute_env(cls, spec: str | None) -> str | None:
        return None if spec is None else absolute_file_spec(spec)

    @pydantic.model_validator(mode="after")
    def _env_or_agent(self) -> RolloutConfig:
        if self.env is not None and self.agent is not None:
            raise ValueError(
                f"rollout.env ({self.env!r}) and rollout.agent ({self.agent!r}) are exclusive: an episode is driven "
                "either by an environment class or by a black-box agent"
            )
        return self


class FSDPSettings(ConfigModel):
    """``trainer.engine=fsdp``: how the group shards the policy (``relax_services.engines.fsdp.train.FSDPConfig``)."""

    activation_checkpointing: bool = False
    """Recompute each decoder block (attention and MLP) in the backward pass, keeping only its input."""

    reshard_after_forward: bool = True
    """Free each block's gathered parameters after its forward (ZeRO-3, least memory); False keeps them until the
    backward (ZeRO-2, less traffic)."""

    cpu_offload: bool = False
    """Keep parameter shards, gradients and optimizer state in host memory (GPU runs; the optimizer steps on the
    CPU)."""


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

    gpus_per_rank: GpuCount = 1.0
    """GPUs of each Trainer rank (the Trainer's one process with ``trainer.engine=torch``) on a GPU run
    (``run.device``); a fraction shares a device with other roles. A group's ranks are packed on as few nodes as
    hold them."""

    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """The Trainer's compute precision; its weights and optimizer state stay float32. ``auto``: bfloat16 autocast
    on a CUDA device that supports it, float32 on the CPU."""

    fsdp: FSDPSettings = pydantic.Field(default_factory=FSDPSettings)
    """Sharding settings of a Trainer group (``trainer.engine=fsdp``)."""

    tensor_parallel: int = pydantic.Field(default=1, ge=1)
    """Tensor-parallel degree of a Trainer group (``trainer.engine=fsdp``): each decoder block's attention and MLP
    split over this many ranks (it must divide ``world_size``, and the model's attention heads, key/value heads and
    MLP width); the group is ``world_size / tensor_parallel`` data-parallel ranks of ``tensor_parallel`` each."""

    layout: Literal["given", "auto"] = "given"
    """How the Trainer group's mesh is chosen: ``given`` takes ``tensor_parallel`` and ``sequence_parallel`` as
    written; ``auto`` lets relax-parallel's planner choose them for ``world_size`` from the model's config, the
    data (modality mix, prompt lengths, image sizes and audio lengths of the first training rows),
    ``rollout.max_new_tokens`` and the devices, among the layouts the FSDP group executes. A degree written
    explicitly wins over the planner. ``relax plan`` and ``relax train`` print the choice and why."""

    sequence_parallel: int = pydantic.Field(default=1, ge=1)
    """Sequence-parallel degree of a Trainer group (``trainer.engine=fsdp``, Ulysses): every sequence of a
    micro-batch split into this many contiguous slices, one per rank, with an all-to-all over attention heads
    around each attention layer. It must divide ``world_size / tensor_parallel`` and the model's attention heads per
    tensor-parallel rank (key/value heads it does not divide are exchanged expanded, one copy per query head), and
    works with padded rows only (not ``trainer.packing``); the group
    is ``world_size / (tensor_parallel × sequence_parallel)`` data-parallel ranks, and the ranks of one sp group
    train on the same samples."""

    groups_per_step: int = pydantic.Field(default=32, ge=1)
    """Prompt groups per optimizer update (samples per update = groups_per_step × algorithm.group_size)."""

    micro_batch_groups: int = pydantic.Field(default=32, ge=1)
    """Groups per forward/backward micro-batch (gradient accumulation when smaller than groups_per_step). When
    not given: the largest divisor of groups_per_step that is at most 32, so ``trainer.groups_per_step=4`` alone
    is a valid run."""

    scoring_chunk_tokens: int = pydantic.Field(default=1024, ge=1)
    """Response tokens whose logits the LM head computes at once when the Trainer, the Reference and the Critic score
    (``engines/scoring.py``): scoring holds a few ``[chunk, V]`` float32 tensors, never ``[tokens, V]``. At
    V = 151,936 one such tensor is 0.62 GB at 1,024; lower it when memory is short, raise it for a GPU's speed."""

    max_tokens_per_micro_batch: int | None = pydantic.Field(default=None, ge=1)
    """Cut micro-batches by tokens instead of groups: consecutive samples up to this many prompt + response tokens
    each (a sample's prompt counts for each row, since each row holds its own copy of the prompt's keys); a longer
    sample forms a micro-batch of its own, never dropped (logged once). The loss weighting stays exact. None: by
    ``micro_batch_groups``."""

    packing: bool = False
    """Run each micro-batch's responses packed into one row instead of right-padded to the longest: no padding
    position is computed, each token attends to its own prompt's cached keys and its own response only (the same
    numbers to float rounding). Needs ``sdpa`` or ``eager`` attention (a dense block mask of ``tokens × (distinct
    prompts' tokens + tokens)``); the update's ``padding_frac`` metric is then 0."""

    activation_checkpointing: bool = False
    """Recompute each text decoder block (attention and MLP) in the backward pass, keeping only its input (the
    one-process engine, ``trainer.engine=torch``; a Trainer group has ``trainer.fsdp.activation_checkpointing``): less
    memory for one more forward of the decoder per micro-batch, the same numbers."""

    minibatches: int = pydantic.Field(default=1, ge=1)
    """Optimizer steps per update, each on an equal slice of whole groups (PPO minibatches). With more than one,
    the proximal log-probs of decoupled PPO are computed once, before the first."""

    ppo_epochs: int = pydantic.Field(default=1, ge=1)
    """Passes over the minibatches per update."""

    total_steps: int = pydantic.Field(default=1000, ge=1)
    """Stop after this many updates."""

    max_minutes: float | None = pydantic.Field(default=8.0, gt=0.0)
    """Stop after this many wall-clock minutes counted from the command (start-up included, and a resumed run's
    earlier time): the run stops at its first check once that clock reaches the limit (None: no limit)."""

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

    samples_per_task: int = pydantic.Field(default=4, ge=0)
    """Conversations of each task that every evaluation writes to ``<run>/samples/eval_step_<version>.jsonl`` (the
    first held-out prompts of the task, so each evaluation shows the same ones; ``relax view`` shows them). 0: none."""

    gpus: GpuCount = 1.0
    """GPUs of the Evaluator's process on a GPU run (``run.device``; 0: it decodes on the CPU)."""

    dtype: Dtype = "auto"
    """Dtype of the Evaluator's weights; ``auto``: bfloat16 on GPU, float32 on the CPU."""


class ReferenceConfig(ConfigModel):
    """The Reference (log-probs of the initial policy, for the KL term)."""

    gpus: GpuCount = 1.0
    """GPUs of the Reference's process on a GPU run (``run.device``)."""

    dtype: Dtype = "auto"
    """Dtype of the Reference's weights; ``auto``: bfloat16 on GPU, float32 on the CPU."""


class CriticConfig(ConfigModel):
    """The Critic (values for PPO's GAE; trained by the Trainer, its weights read here)."""

    gpus: GpuCount = 1.0
    """GPUs of the Critic's process on a GPU run (``run.device``)."""


class HealthConfig(ConfigModel):
    """Heartbeats and restarts."""

    heartbeat_timeout_s: float = pydantic.Field(default=30.0, gt=0.0)
    """A service whose progress counter has not moved for this long is declared hung."""

    max_restarts: int = pydantic.Field(default=3, ge=0)
    """In-place restarts per service, and replacements per shared process (``run.hosts``), before the next failure
    is a global restart from the last checkpoint. A service counts its own failures: a loop that raised (rebuilt in
    its process), hung, or could not be rebuilt, and the death of a process of its own. A shared host counts its
    replacements: a host that died counts against the host only (not against the roles it held, which restart with
    it), and a host replaced because one of its roles hung or could not be rebuilt inside it counts against the host
    and that role."""

    restart_backoff_s: float = pydantic.Field(default=1.0, ge=0.0)
    """First restart delay; doubles with every restart counted against what is restarted (the service, or the host
    and the role that brought its replacement: the larger count)."""

    max_global_restarts: int = pydantic.Field(default=2, ge=0)
    """Restarts of the whole run from its last checkpoint (after a Trainer failure, or a service that kept
    failing) before the run stops with an error."""
