"""Trainer service: consumes whole groups whose fields are all present, computes advantages and the policy
loss (relax-core), applies one policy update, publishes the new weights, then acks the batch and publishes the
version in one queue call.

Per update the trainer makes two queue calls (each one round trip to the queue actor in the distributed mode): the
get, which leases the batch for the whole update (``lease_s``, so no renewal call), and ``ack_and_publish``. With
the queue in another process and τ ≥ 1 the get of the next batch is made while the update computes
(``services/_prefetch.py``)."""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path

import torch

from relax_core import (
    KLController,
    aggregation_units,
    algorithm_spec,
    compute_advantages,
    compute_policy_loss,
    policy_loss_units,
    value_loss,
)
from relax_queue import Batch, GroupBatcher, QueueClient, QueueTimeoutError, TransferQueue
from relax_services.config import RunConfig
from relax_services.engines import LOSS_MASK_FIELD, LossFn, LossInputs, LossResult, TrainEngine, TrainSample
from relax_services.engines.protocols import RankOptions
from relax_services.engines.registry import make_train_engine
from relax_services.engines.torch import build_value_engine
from relax_services.rows import SampleRow, as_sample_row, loss_mask_of, split_sample_key
from relax_services.services._base import HealthHandle, ServiceBase
from relax_services.services._hold import StepHold
from relax_services.services._mismatch import (
    CURRENT_VERSION_FIELD,
    current_version_mask,
    mismatch_sums,
    pop_rollout_mismatch,
)
from relax_services.services._prefetch import BatchPrefetch
from relax_services.weights import WeightStore
from relax_services.weights.packed import memcpy_seconds

__all__ = [
    "TrainerService",
    "build_train_samples",
    "env_token_frac",
    "informative_rows",
    "make_loss_fn",
    "make_value_loss_fn",
    "proximal_logprobs",
    "publishes_adapters",
    "sample_order",
    "trainer_fields",
]


_TRAIN_LEASE_S = 3600.0  # one update never takes this long; the trainer acks right after it
_GET_TIMEOUT_S = 0.5  # a get's wait for a batch: the loop comes back to beat and to check for a hold between gets


def sample_order(key: str) -> tuple[str, int]:
    """Sort key of a sample row key ``"<prompt key>/<index in group>"``: by prompt, then index."""
    return split_sample_key(key)


def publishes_adapters(cfg: RunConfig) -> bool:
    """Whether the Trainer publishes each version as its adapters alone (``rollout.vllm.lora_requests``, which the
    config allows only with ``model.lora`` and ``rollout.engine=vllm``): every reader of the policy's weight store,
    the Rollout workers and the Evaluator, then runs a vLLM engine that serves them as LoRA requests over the base
    checkpoint it loaded. Otherwise the whole policy (with ``model.lora``, the adapters merged in), which every engine
    loads."""
    return cfg.rollout.vllm.lora_requests and cfg.model.lora is not None and cfg.rollout.engine == "vllm"


def trainer_fields(cfg: RunConfig) -> list[str]:
    """The sample fields one update needs; a row reaches the trainer only when all of them exist (``loss_mask``
    included: the Rollout always writes it, and a restored snapshot of an older run gets it,
    :func:`~relax_services.control.checkpoint.load_queue_snapshots`)."""
    fields = ["prompt", "meta", "response", "logprobs", "token_versions", "loss_mask", "reward", "reward_error"]
    if cfg.algorithm.uses_reference:
        fields.append("ref_logprobs")
    if cfg.algorithm.uses_critic:
        fields.append("values")
    return fields


def _pad(rows: list[list[float]], length: int) -> torch.Tensor:
    out = torch.zeros(len(rows), length)
    for i, values in enumerate(rows):
        out[i, : len(values)] = torch.as_tensor(values, dtype=torch.float32)
    return out


def env_token_frac(batch_rows: Sequence[SampleRow]) -> float:
    """Environment tokens (``loss_mask`` 0) over all response tokens of ``batch_rows``."""
    total = sum(len(r["response"]) for r in batch_rows)
    policy = sum(sum(loss_mask_of(r)) for r in batch_rows)
    return (total - policy) / max(total, 1)


def _reward_baselines(cfg: RunConfig, batch_rows: Sequence[SampleRow]) -> torch.Tensor | None:
    """``[B]`` each row's greedy-response reward (``meta.reward_baseline``, the Rollout's) when the estimator takes
    one (remax), else None."""
    if not algorithm_spec(cfg.algorithm.advantage_estimator).needs_greedy_baseline:
        return None
    return torch.tensor([float(r["meta"]["reward_baseline"]) for r in batch_rows])


def informative_rows(batch_rows: Sequence[SampleRow]) -> list[SampleRow]:
    """The rows of groups whose rewards are not all equal (DAPO's dynamic sampling, ``algorithm.filter_groups``):
    a group where every sample scored the same has zero group-relative advantage, so it only dilutes the update."""
    by_group: dict[str, set[float]] = defaultdict(set)
    for r in batch_rows:
        by_group[r["meta"]["prompt_key"]].add(float(r["reward"]))
    return [r for r in batch_rows if len(by_group[r["meta"]["prompt_key"]]) > 1]


def build_train_samples(
    cfg: RunConfig,
    batch_rows: Sequence[SampleRow],
    proximal_logprobs: torch.Tensor | None = None,
    version: int | None = None,
) -> list[TrainSample]:
    """Turn consumed rows (plain field dicts) into training samples with advantages attached (and, with a
    critic, the values the rows were scored with and the regression targets: GAE returns or V-trace targets).

    Shared by the Trainer service and by the synchronous reference loops in the tests, so they compute the
    same update from the same rows.

    Environment tokens (a row's ``loss_mask`` 0) are context only: they leave the mask every estimator sees (its
    recursions carry credit across them, relax-core's convention; their advantages and returns are 0) and each
    sample carries its mask as the :data:`~relax_services.engines.LOSS_MASK_FIELD` field, which the engines
    multiply into every loss's mask (policy loss, KL, entropy, value loss, their units and the mismatch metrics).

    Args:
        proximal_logprobs: ``[B, T]`` the trainer's log-probs before this update (:func:`proximal_logprobs`):
            V-trace's target policy and decoupled PPO's proximal policy.
        version: The trainer's version before this update: when given, each sample gets the per-token
            ``current_version`` field its loss measures the rollout/trainer mismatch on (``services/_mismatch.py``).
    """
    lengths = [len(r["response"]) for r in batch_rows]
    t_max = max(lengths)
    loss_masks = [torch.tensor(loss_mask_of(r), dtype=torch.float32) for r in batch_rows]  # [L_i] each
    mask = torch.zeros(len(batch_rows), t_max)  # [B, T]: the policy's tokens (padding and env tokens 0)
    for i, n in enumerate(lengths):
        mask[i, :n] = loss_masks[i]
    scores = torch.tensor([float(r["reward"]) for r in batch_rows])  # [B]
    old_logprobs = _pad([r["logprobs"] for r in batch_rows], t_max)  # [B, T]
    ref = _pad([r["ref_logprobs"] for r in batch_rows], t_max) if "ref_logprobs" in batch_rows[0] else None
    values = _pad([r["values"] for r in batch_rows], t_max) if "values" in batch_rows[0] else None
    estimate = compute_advantages(
        cfg.algorithm,
        scores,
        mask,
        group_ids=[r["meta"]["prompt_key"] for r in batch_rows],
        values=values,
        old_logprobs=old_logprobs,
        proximal_logprobs=proximal_logprobs,
        ref_logprobs=ref,
        reward_baselines=_reward_baselines(cfg, batch_rows),
    )
    adv = estimate.advantages  # [B, T]
    samples = []
    for i, row in enumerate(batch_rows):
        n = lengths[i]
        fields = {"old_logprobs": old_logprobs[i, :n], "advantages": adv[i, :n], LOSS_MASK_FIELD: loss_masks[i]}
        if ref is not None:
            fields["ref_logprobs"] = ref[i, :n]
        if proximal_logprobs is not None:
            fields["proximal_logprobs"] = proximal_logprobs[i, :n]
        if version is not None:
            fields[CURRENT_VERSION_FIELD] = current_version_mask(row["token_versions"], version)
        if values is not None and estimate.returns is not None:
            fields["old_values"] = values[i, :n]
            fields["returns"] = estimate.returns[i, :n].detach()
        samples.append(TrainSample(prompt=row["prompt"], response_ids=torch.tensor(row["response"]), fields=fields))
    return samples


def proximal_logprobs(cfg: RunConfig, engine: TrainEngine, batch_rows: Sequence[SampleRow]) -> torch.Tensor | None:
    """``[B, T]`` log-probs of the responses under the trainer's policy before this update, when the update
    needs them up front: an estimator whose table entry ``needs_proximal_logprobs`` (V-trace: its target policy)
    and decoupled PPO over several optimizer steps (the proximal policy must stay the one before the first
    step). Otherwise None: a one-step update's own forward is the proximal policy."""
    multi_step = cfg.trainer.minibatches * cfg.trainer.ppo_epochs > 1
    upfront = algorithm_spec(cfg.algorithm.advantage_estimator).needs_proximal_logprobs
    if not upfront and not (cfg.algorithm.decoupled and multi_step):
        return None
    samples = [TrainSample(prompt=r["prompt"], response_ids=torch.tensor(r["response"])) for r in batch_rows]
    logprobs: torch.Tensor = engine.compute_logprobs(samples)[0]  # [B, T]
    return logprobs


def make_value_loss_fn(cfg: RunConfig) -> LossFn:
    """The critic's loss per micro-batch: relax-core's clipped value loss against the rows' targets, with the
    units it averages over (the engine combines micro-batches by them). ``inputs.mask`` leaves environment tokens
    out (the engine multiplies the samples' loss masks in), so the critic regresses on policy tokens only."""
    algo = cfg.algorithm

    def loss_fn(inputs: LossInputs) -> LossResult:
        assert inputs.values is not None, "the critic's engine scores values"
        loss, diagnostics = value_loss(
            inputs.values,
            inputs.fields["old_values"],
            inputs.fields["returns"],
            inputs.mask,
            algo.value_clip_eps,
            algo.loss_agg_mode,
        )
        return LossResult(algo.value_loss_coef * loss, aggregation_units(inputs.mask, algo.loss_agg_mode), diagnostics)

    return loss_fn


def make_loss_fn(cfg: RunConfig) -> LossFn:
    """The loss the training engine calls per micro-batch: relax-core's policy objective for the algorithm.

    With ``decoupled`` (decoupled PPO, for stale data) the proximal policy is the trainer's policy before this
    update: the samples' ``proximal_logprobs`` field when the update takes several optimizer steps
    (:func:`add_proximal_logprobs`), otherwise exactly the detached log-probs of this forward.

    Samples with the ``current_version`` field also report the rollout/trainer mismatch
    (``services/_mismatch.py``).

    ``inputs.mask`` already excludes environment tokens (the engine multiplies the samples'
    :data:`~relax_services.engines.LOSS_MASK_FIELD` in), so every term, ratio, unit and mismatch count below is over
    the policy's own tokens.

    The result carries the units the loss averages over (kept tokens or sequences after masked IS), so the engine
    combines micro-batches into exactly the loss of the whole batch however masked IS splits them.
    """
    algo = cfg.algorithm
    one_step = cfg.trainer.minibatches * cfg.trainer.ppo_epochs == 1

    def loss_fn(inputs: LossInputs) -> LossResult:
        proximal = inputs.fields.get("proximal_logprobs", inputs.logprobs.detach()) if algo.decoupled else None
        units = policy_loss_units(algo, inputs.fields["old_logprobs"], inputs.mask, proximal)
        loss, diagnostics = compute_policy_loss(
            algo,
            inputs.logprobs,
            inputs.fields["old_logprobs"],
            inputs.fields["advantages"],
            inputs.mask,
            proximal_logprobs=proximal,
            ref_logprobs=inputs.fields.get("ref_logprobs"),
            entropy=inputs.entropy,
            full_kl=inputs.full_kl,  # the engine's, summed over the vocabulary where the logits are
        )
        current = inputs.fields.get(CURRENT_VERSION_FIELD)
        before = inputs.fields.get("proximal_logprobs", inputs.logprobs.detach() if one_step else None)
        if current is not None and before is not None:
            old = inputs.fields["old_logprobs"]
            diagnostics.update(mismatch_sums(before, old, inputs.mask, current, units=units))
        return LossResult(loss, units, diagnostics)

    return loss_fn


def _realised_plan(cfg: RunConfig, engine: TrainEngine) -> str:
    """The Trainer's layout as the engine built it: a group's rank 0 reads it back from its mesh; a one-process
    engine has no mesh, and its text is the config's."""
    from relax_services.engines.fsdp.group import TrainerGroup
    from relax_services.engines.trainer_plan import trainer_plan_text

    return engine.plan_text if isinstance(engine, TrainerGroup) else trainer_plan_text(cfg)


class TrainerService(ServiceBase):
    """The policy update loop (its own process)."""

    def __init__(
        self,
        name: str,
        cfg: RunConfig,
        sample_queue: QueueClient,
        weights: WeightStore,
        restore_from: str | None = None,
        *,
        critic_weights: WeightStore | None = None,
        health: HealthHandle | None = None,
        placement: RankOptions | None = None,
    ) -> None:
        super().__init__(name, health)
        self.cfg = cfg
        self.queue = sample_queue
        self.weights = weights
        # trainer.engine, from the engine registry; a group's ranks go to their bundles on a GPU run
        self.engine: TrainEngine = make_train_engine(cfg, placement=placement)
        self.record("plan", text=_realised_plan(cfg, self.engine))  # what `relax plan` printed for this config
        # PPO: the critic trains here, next to the policy; the Critic service scores with its published weights.
        self.critic = build_value_engine(cfg) if cfg.algorithm.uses_critic else None
        self.critic_weights = critic_weights
        if self.critic is not None and critic_weights is None:
            raise ValueError(f"advantage_estimator={cfg.algorithm.advantage_estimator!r} needs a critic weight store")
        self.kl_ctrl = KLController.from_config(cfg.algorithm)  # β of the KL term, moved by an adaptive controller
        if restore_from is not None:  # a resumed run or a global restart: continue exactly where it stopped
            state = torch.load(restore_from, map_location="cpu", weights_only=False)
            self.engine.load_state_dict(state)
            if "kl_ctrl" in state:
                self.kl_ctrl.load_state_dict(state["kl_ctrl"])
            if self.critic is not None:
                self.critic.load_state_dict(state["critic"])
        self._hold = StepHold()
        self.loss_fn = make_loss_fn(cfg)
        self.value_loss_fn = make_value_loss_fn(cfg)
        self.reader = sample_queue.reader(
            "trainer", fields=trainer_fields(cfg), batcher=GroupBatcher(cfg.trainer.groups_per_step)
        )
        tau = cfg.staleness.tau
        # In one process a get is a call without a round trip, and a second thread only competes for the GIL.
        remote = not isinstance(sample_queue, TransferQueue)
        self._prefetch = (
            BatchPrefetch(self.reader, tau, _TRAIN_LEASE_S, _GET_TIMEOUT_S) if remote and tau != 0 else None
        )
        self._memcpy_s: dict[int, float] = {}  # {bytes: seconds of a plain copy}: what a publish is printed against
        self._publish()
        self._wait_s = 0.0

    @property
    def version(self) -> int:
        """Policy updates applied so far."""
        return int(self.engine.version)

    def inject(self, kind: str) -> None:
        """Fault injection: ``"kill_rank"`` makes the last rank of a Trainer group die inside the next update;
        other kinds as every service."""
        if kind != "kill_rank":
            super().inject(kind)
            return
        from relax_services.engines.fsdp.group import TrainerGroup

        if not isinstance(self.engine, TrainerGroup):
            raise ValueError(f"inject 'kill_rank' needs a Trainer group, not {type(self.engine).__name__}")
        self.engine.arm_kill(self.engine.group.world_size - 1)

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the loop, then the engine's processes when it has its own (a Trainer group's ranks)."""
        stopped = super().stop(timeout)
        if self._prefetch is not None and stopped:  # the loop is out: nothing else uses the reader
            self._prefetch.close()
        self.engine.shutdown()
        return stopped

    def _publish(self, consumed: Batch | None = None) -> None:
        """Publish the weights, then the version to the queue; with ``consumed`` (the batch the update trained on)
        the batch is acked in the same queue call, so it is consumed as the version becomes visible (never
        counted as stale against the version it produced) and no snapshot sees one without the other."""
        if self.critic is not None:  # before the version is visible, so a Critic that catches up to it finds it
            assert self.critic_weights is not None  # checked in __init__
            self.critic_weights.publish(self.version, self.critic.policy_state(copy=False))
        # Views of the live weights: every store copies them as it publishes (the object store's put, the
        # in-process store's copy), so a version costs one copy of the model, not two.
        stats = self.weights.publish(self.version, self._policy_for_readers())
        start = time.perf_counter()
        if consumed is None:
            self.queue.publish_version(self.version)
        else:
            self.reader.ack_and_publish(consumed, self.version)
        self._version_s = time.perf_counter() - start
        self._sync_s = stats.seconds
        self._sync_bytes = stats.num_bytes
        if stats.num_bytes not in self._memcpy_s:  # the yardstick, once per size
            self._memcpy_s = {stats.num_bytes: memcpy_seconds(stats.num_bytes)}

    def _policy_for_readers(self) -> dict[str, torch.Tensor]:
        """What readers get of a version (:func:`publishes_adapters`): the adapters alone, served by vLLM as LoRA
        requests, or the whole policy (with ``model.lora`` the adapters merged in)."""
        if not publishes_adapters(self.cfg):
            return self.engine.policy_state(copy=False)
        adapters = getattr(self.engine, "adapter_state", None)
        if adapters is None:
            raise ValueError(
                f"rollout.vllm.lora_requests=true: the trainer engine {type(self.engine).__name__} cannot give its "
                "adapters alone; set rollout.vllm.lora_requests=false"
            )
        state: dict[str, torch.Tensor] = adapters()
        return state

    def pause(self, timeout: float = 300.0) -> int:
        """Hold the loop between updates (for a consistent checkpoint); returns the version it holds at."""
        self._hold.request(timeout)
        return self.version

    def resume(self) -> None:
        """Release a :meth:`pause`."""
        self._hold.release()

    def save_engine(self, path: str) -> int:
        """Write model, optimizer, scheduler, RNG, version and the KL coefficient to ``path`` (call while paused)."""
        # Views of the live state, written now while the loop is held: no second copy of weights and moments.
        state = self.engine.state_dict(copy=False)
        state["kl_ctrl"] = self.kl_ctrl.state_dict()
        if self.critic is not None:
            state["critic"] = self.critic.state_dict(copy=False)
        torch.save(state, path)
        return self.version

    def export_hf(self, checkpoint_dir: str) -> str:
        """Write checkpoint ``checkpoint_dir``'s policy (and critic) in Hugging Face format into its ``hf`` folder
        (:func:`~relax_services.models.export.export_checkpoint`), here where the model stack is loaded; returns the
        folder. Safe while training goes on: it reads the checkpoint's files, not this engine."""
        from relax_services.models.export import HF_FOLDER, export_checkpoint

        return str(export_checkpoint(checkpoint_dir, self.cfg.model, Path(checkpoint_dir) / HF_FOLDER))

    def step(self) -> None:
        """One update: lease whole groups, train on them, publish the new weights and version, ack."""
        if self._hold.at_boundary():
            self._stop.wait(0.05)  # the loop keeps beating while held, so it is not taken for hung
            return
        if self.version >= self.cfg.trainer.total_steps:
            if self._prefetch is not None:
                self._prefetch.give_back()  # no update will consume it
            self._stop.wait(0.2)
            return
        start = time.perf_counter()
        batch = None if self._prefetch is None else self._prefetch.take(self.version)
        try:  # leased for the whole update (an expired lease would hand the batch out twice)
            if batch is None:
                batch = self.reader.get(timeout=_GET_TIMEOUT_S, lease_s=_TRAIN_LEASE_S)
        except QueueTimeoutError:
            self._wait_s += time.perf_counter() - start
            return
        self._wait_s += time.perf_counter() - start
        if self._hold.requested:
            # A pause asked for while the lease was pending holds at the version it was asked at: the batch goes
            # back for redelivery (the run's first checkpoint is then always that of step 0).
            self.reader.nack(batch)
            return
        self._train_on(batch)

    def _with_kl_coef(self) -> tuple[RunConfig, float]:
        """The run config with the KL controller's current β (the run's own when it is unchanged), and β."""
        beta = self.kl_ctrl.value
        if beta == self.cfg.algorithm.kl_coef:
            return self.cfg, beta
        return self.cfg.model_copy(update={"algorithm": self.cfg.algorithm.model_copy(update={"kl_coef": beta})}), beta

    def _train_on(self, batch: Batch) -> None:
        start = time.perf_counter()
        if self._prefetch is not None:
            self._prefetch.start()  # the next batch's get overlaps this update
        delivered = sorted(batch.rows, key=lambda row: sample_order(str(row.key)))  # delivery order may vary
        rows = [as_sample_row(row.fields) for row in delivered]
        version_before = self.version
        trained = informative_rows(rows) if self.cfg.algorithm.filter_groups else rows
        if not trained:  # every group scored uniformly: no signal, no update; the rows are still consumed
            self.reader.ack(batch)
            self.queue.refund_admission(len(rows))  # the version did not advance: let producers replace them
            self.record("filtered", rows=len(rows), keys=[str(k) for k in batch.keys])
            return
        proximal = proximal_logprobs(self.cfg, self.engine, trained)
        cfg, kl_coef = self._with_kl_coef()
        samples = build_train_samples(cfg, trained, proximal, version=version_before)
        metrics = self.engine.step(samples, self.loss_fn if cfg is self.cfg else make_loss_fn(cfg))
        if "kl" in metrics:
            self.kl_ctrl.update(float(metrics["kl"]), len(trained))
        pop_rollout_mismatch(metrics)
        if self.critic is not None:
            critic_metrics = self.critic.step(samples, self.value_loss_fn)
            metrics.update({f"critic_{k}": v for k, v in critic_metrics.items() if k not in ("lr", "version")})
        train_s = time.perf_counter() - start
        self._publish(consumed=batch)
        queue_s = self._version_s  # the update's queue call besides the get: the ack with the version
        by_task: dict[str, list[float]] = defaultdict(list)
        for r in rows:
            by_task[r["meta"]["task"]].append(float(r["reward"]))
        staleness = Counter(row.staleness for row in batch.rows)
        # Recomputed from the per-token versions the rollout recorded (independent of the queue's bookkeeping).
        token_staleness = Counter(version_before - min(r["token_versions"]) for r in rows)
        self.record(
            "train",
            step=self.version,
            samples=len(rows),
            reward=sum(float(r["reward"]) for r in rows) / len(rows),
            rewards=[float(r["reward"]) for r in rows],
            reward_by_task={t: sum(v) / len(v) for t, v in by_task.items()},
            staleness_hist={str(k): v for k, v in sorted(staleness.items())},
            max_staleness=max(staleness),
            # Rows of a restored older snapshot name no replica: counted under "".
            samples_by_replica=dict(sorted(Counter(r["meta"].get("replica", "") for r in rows).items())),
            token_staleness_hist={str(k): v for k, v in sorted(token_staleness.items())},
            stale_flagged=sum(row.stale for row in batch.rows),
            reward_failures=sum(r["reward_error"] is not None for r in rows),
            filtered_rows=len(rows) - len(trained),
            env_token_frac=env_token_frac(trained),
            kl_coef=kl_coef,
            wait_s=self._wait_s,
            train_s=train_s,
            weight_sync_s=self._sync_s,
            weight_sync_bytes=self._sync_bytes,
            weight_sync_memcpy_s=self._memcpy_s.get(self._sync_bytes, 0.0),
            queue_s=queue_s,
            keys=[str(k) for k in batch.keys],
            **{k: float(v) for k, v in metrics.items()},
        )
        self._wait_s = 0.0
