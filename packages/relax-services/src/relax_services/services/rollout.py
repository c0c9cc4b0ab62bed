"""Rollout service: reads prompt rows, generates a group of completions per prompt with the newest weights,
and writes one sample row per completion into the sample queue."""

from __future__ import annotations

import hashlib
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from relax_core import algorithm_spec
from relax_queue import Batch, FixedSizeBatcher, QueueClient, QueueTimeoutError, Row, RowInput
from relax_services.config import RunConfig
from relax_services.data.prompts import PromptBuilder
from relax_services.engines import Completion, RolloutEngine, SamplingParams
from relax_services.engines.registry import make_rollout_engine
from relax_services.engines.sampling import sampling_params
from relax_services.models import OmniPrompt
from relax_services.rows import (
    RolloutFields,
    SampleMeta,
    as_prompt_row,
    as_record_row,
    item_extras,
    reward_request,
    sample_key,
)
from relax_services.services._base import HealthHandle, ServiceBase
from relax_services.weights import WeightPoller, WeightStore
from relax_services.weights.broadcast_store import BroadcastWeightStore

if TYPE_CHECKING:
    from relax_services.agents import AgentRunner, Episode, EpisodeRunner

__all__ = ["ENV_RETRIES", "GreedyBaseline", "RolloutService", "episode_metrics", "sampling_seed"]


def sampling_seed(run_seed: int, prompt_keys: list[str]) -> int:
    """Seed of one generate call, derived from the run seed and its prompt keys (not from process state), so
    a restarted rollout, or the synchronous reference loop, draws exactly the same samples for the same prompts."""
    digest = hashlib.sha256(f"{run_seed}|{'|'.join(prompt_keys)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class RolloutService(ServiceBase):
    """One Rollout worker (its own process). Prompt leases are acked only after the samples are stored, so a
    worker that dies mid-generation loses nothing: its prompts are redelivered and regenerated."""

    def __init__(
        self,
        name: str,
        cfg: RunConfig,
        prompt_queue: QueueClient,
        sample_queue: QueueClient,
        weights: WeightStore,
        *,
        to_prompt: PromptBuilder | None = None,
        health: HealthHandle | None = None,
    ) -> None:
        super().__init__(name, health)
        self.to_prompt = to_prompt
        self._prompts: dict[str, OmniPrompt] = {}  # a record row's cache key -> its prompt, built here once
        self.cfg = cfg
        self.prompt_queue = prompt_queue
        self.sample_queue = sample_queue
        self.weights = weights
        self.engine: RolloutEngine = make_rollout_engine(cfg)  # rollout.engine, from the engine registry
        self.params = sampling_params(
            cfg.model,
            n=cfg.algorithm.group_size,
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
        )
        # Prompt rows carry the prompt; record rows (a feeder without a prompt builder) the dataset row, built here.
        fields = ["item", "prompt"] if to_prompt is None else ["item", "record", "cache_key"]
        self.reader = prompt_queue.reader("rollout", fields=fields, batcher=FixedSizeBatcher(cfg.rollout_call_groups))
        # In process a poll is a dict lookup; across processes an actor call (the store says which interval fits).
        interval = float(getattr(weights, "poll_interval_s", 0.05))
        self._no_paths: dict[int, str] = {}
        self._poll = WeightPoller(weights, lambda: self.engine.version, min_interval_s=interval)
        self._load_s: dict[int, float] = {}  # version -> seconds engine.load_weights took (loads made here)
        self._blocked_s = 0.0  # seconds unable to work since the last record (the autoscaler's blocked share)
        # remax: each prompt's greedy response, scored here, is its samples' baseline (never trained on)
        needs_baseline = algorithm_spec(cfg.algorithm.advantage_estimator).needs_greedy_baseline
        self.baseline = GreedyBaseline(cfg) if needs_baseline else None
        # rollout.env / rollout.agent: each prompt row's group is G multi-turn episodes, one environment instance
        # (or one agent call with its own endpoint session) each
        multi_turn = cfg.rollout.env is not None or cfg.rollout.agent is not None
        self.episodes = _episode_runner(cfg, self.engine, self.params) if multi_turn else None
        self._sync_weights()  # a (re)started worker begins from the newest published weights

    def _paths(self) -> dict[int, str]:
        """``{version: path}`` of the versions fetched since the last record (the broadcast store tells them)."""
        return self.weights.paths if isinstance(self.weights, BroadcastWeightStore) else self._no_paths

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the loop, then the broadcast receiver's thread and the environments' thread pool when there are."""
        stopped = super().stop(timeout)
        if stopped and self.episodes is not None:
            self.episodes.close()
        if stopped and self.baseline is not None:
            self.baseline.close()
        if isinstance(self.weights, BroadcastWeightStore):
            self.weights.close()
        return stopped

    def _sync_weights(self) -> None:
        newer = self._poll()
        if newer is not None:
            start = time.perf_counter()
            self.engine.load_weights(newer[1], newer[0])
            self._load_s[newer[0]] = time.perf_counter() - start

    def policy_version(self) -> int:
        """Pull the newest published weights and return the version this replica now holds (a replica joining a
        running run is admitted only once it holds the Trainer's version: ``relax scale``)."""
        self._sync_weights()
        return self.engine.version

    def _catch_up(self, batch: Batch) -> None:
        """Load weights at least as new as the trainer's published version before generating: samples drawn
        with older weights would only be stale (e.g. right after a restart, before the trainer republishes)."""
        self.catch_up(self.sample_queue.version, lambda: self.engine.version, self._sync_weights, self.reader, batch)

    def _ready_prompts(self, batch: Batch) -> list[tuple[Row, OmniPrompt]]:
        """Each prompt row with its prompt: the row's own, or built here from a record row (cached by the row's
        cache key). A record whose media cannot be read is skipped: its group's admission is given back and a
        ``skipped`` record (before the ack, so a checkpoint that misses the prompt row sees the record) tells the
        controller, which counts it with its file, row and reason as the feeder counted bad rows."""
        if self.to_prompt is None:
            return [(row, as_prompt_row(row.fields)["prompt"]) for row in batch.rows]
        from relax_modalities import MediaError

        ready = []
        for row in batch.rows:
            record = as_record_row(row.fields)
            cache_key = record["cache_key"]
            prompt = None if cache_key is None else self._prompts.get(cache_key)
            if prompt is None:
                try:
                    prompt = self.to_prompt(record["record"])
                except MediaError as exc:
                    self.sample_queue.release_admission(self.cfg.algorithm.group_size)
                    self.record("skipped", prompt_key=str(row.key), reason=f"{exc.modality}: {exc.reason}")
                    continue
                if cache_key is not None:
                    self._prompts[cache_key] = prompt
            ready.append((row, prompt))
        return ready

    def _run_episodes(
        self, ready: list[tuple[Row, OmniPrompt]]
    ) -> tuple[
        list[tuple[Row, OmniPrompt]],
        list[list[OmniPrompt]],
        list[list[Completion]],
        list[list[float | None]],
        dict[str, float],
    ]:
        """``rollout.env`` or ``rollout.agent``: each prompt row's group as G episodes (its item handed to each
        environment's ``reset``, or to each agent call as its ``task``).

        A group with an episode marked for requeue (``rollout.env_failure=requeue``, or a ``reset`` that failed) is
        run again, up to :data:`ENV_RETRIES` times, with fresh environments; a group that still fails is skipped:
        its admission is given back and a ``skipped`` record names the environment's error (counted in the ledger
        as the feeder counts bad rows, never lost).

        Returns:
            The rows kept, each sample's prompt (the first turn's rendered ids, with every media item of the
            episode: :meth:`~relax_services.agents.Episode.sample_prompt`), completions (their masks mark the
            environment's tokens), the environments' rewards (None: ``reward.fn`` scores the response) and the
            metrics of the call (``turns_mean``, ``tool_calls``, ``tool_errors``, ``tool_timeouts``,
            ``env_failures``, ``env_token_frac``, and ``prefix_breaks`` for an agent).
        """
        assert self.episodes is not None
        items = [as_prompt_row(row.fields)["item"] for row, _ in ready]
        size = self.params.n
        groups = self.episodes.run_sync(items, size, self._poll) if ready else []
        for _ in range(ENV_RETRIES):
            redo = [i for i, group in enumerate(groups) if any(ep.requeue for ep in group)]
            if not redo:
                break
            again = self.episodes.run_sync([items[i] for i in redo], size, self._poll)
            for i, group in zip(redo, again, strict=True):
                groups[i] = group
        kept, prompts, completions, rewards = [], [], [], []
        for (row, prompt), group in zip(ready, groups, strict=True):
            failed = next((ep for ep in group if ep.requeue), None)
            if failed is not None:
                self.sample_queue.release_admission(len(group))
                self.record("skipped", prompt_key=str(row.key), reason=f"environment: {failed.error}")
                continue
            kept.append((row, prompt))
            prompts.append([ep.sample_prompt() for ep in group])
            completions.append([ep.to_completion() for ep in group])
            rewards.append([ep.reward for ep in group])
        return kept, prompts, completions, rewards, episode_metrics([ep for group in groups for ep in group])

    def step(self) -> None:
        """Generate one batch of prompt groups with the newest weights, put their sample rows, ack the prompts."""
        asked = time.perf_counter()
        try:
            batch = self.reader.get(timeout=0.5)
        except QueueTimeoutError:
            self._blocked_s += time.perf_counter() - asked  # no admitted prompt to take
            self._sync_weights()
            return
        self._catch_up(batch)
        if self.stopping:  # drained while waiting for weights: the prompts go back to the queue for another replica
            self.reader.nack(batch)
            return
        ready = self._ready_prompts(batch)
        keys = [str(row.key) for row, _ in ready]
        self.engine.seed(sampling_seed(self.cfg.trainer.seed, keys))
        start = time.perf_counter()
        counters: dict[str, float] = {}
        with self.keep_leased(self.reader, batch):
            if self.episodes is None:
                groups = (
                    self.engine.generate([p for _, p in ready], self.params, poll_weights=self._poll) if ready else []
                )
                prompts = [[p] * len(g) for (_, p), g in zip(ready, groups, strict=True)]
                rewards: list[list[float | None]] = [[None] * len(g) for g in groups]
                baselines = (
                    self.baseline.rewards(self.engine, ready, self.params) if self.baseline is not None else None
                )
            else:
                ready, prompts, groups, rewards, counters = self._run_episodes(ready)
                baselines = None
        elapsed = time.perf_counter() - start
        rows = []
        for prompt_index, ((row, _), group_prompts, completions, group_rewards) in enumerate(
            zip(ready, prompts, groups, rewards, strict=True)
        ):
            item = as_prompt_row(row.fields)["item"]
            for j, (prompt, completion, env_reward) in enumerate(
                zip(group_prompts, completions, group_rewards, strict=True)
            ):
                meta: SampleMeta = {
                    "task": item["task"],
                    "answer": item["answer"],
                    "prompt_key": str(row.key),
                    "replica": self.name,
                }
                meta.update(item_extras(item))  # type: ignore[typeddict-item]  # the optional keys of both
                if env_reward is not None:  # the environment scored its episode: the Reward service keeps it
                    meta["env_reward"] = env_reward
                if baselines is not None:
                    meta["reward_baseline"] = baselines[prompt_index]
                fields: RolloutFields = {
                    "prompt": prompt,
                    "meta": meta,
                    "response": completion.token_ids,
                    "logprobs": completion.logprobs,
                    "token_versions": completion.versions,
                    "loss_mask": completion.loss_mask,
                }
                rows.append(
                    RowInput(
                        key=sample_key(row.key, j),
                        fields=fields,
                        versions=completion.version_range,
                        group_id=str(row.key),
                        group_size=len(completions),
                        tags={"num_tokens": len(completion.token_ids), "task": item["task"]},
                    )
                )
        if rows:
            put = time.perf_counter()
            self.sample_queue.put_many(rows, admitted=True, timeout=None)
            self._blocked_s += time.perf_counter() - put  # backpressure: the sample queue was full
        self.ack(self.reader, batch)
        self.record(
            "rollout",
            prompts=len(batch),
            samples=len(rows),
            tokens=sum(len(c.token_ids) for group in groups for c in group),
            seconds=elapsed,
            blocked_s=self._blocked_s,
            version=self.engine.version,
            weight_sync_s=dict(self._poll.sync_seconds),
            weight_load_s=dict(self._load_s),
            weight_paths=dict(self._paths()),
            **counters,
        )
        self._blocked_s = 0.0
        self._poll.sync_seconds.clear()
        self._load_s.clear()
        self._paths().clear()


class GreedyBaseline:
    """ReMax's baseline (Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for
    Aligning Large Language Models", Alg. 1): the reward of each prompt's greedy response, generated by the Rollout
    with the same weights right after the group and scored here by the run's reward (``reward.fn`` / ``reward.name``,
    as the Reward service scores), never written as a sample.

    Args:
        cfg: The run config (its reward and checkpoint).
    """

    def __init__(self, cfg: RunConfig) -> None:
        from relax_core import build_reward_runner
        from relax_services.models.decoder import ResponseDecoder, checkpoint_folder

        self.runner = build_reward_runner(cfg.reward.runner_config())
        self.decoder = ResponseDecoder(checkpoint_folder(cfg.model.source, cfg.model.seed))

    def rewards(
        self, engine: RolloutEngine, ready: list[tuple[Row, OmniPrompt]], params: SamplingParams
    ) -> list[float]:
        """The greedy response's reward of each prompt of ``ready`` (a failed reward counts its fallback score)."""
        from relax_services.services.reward import decode_response

        if not ready:
            return []
        greedy = engine.generate([p for _, p in ready], replace(params, n=1, temperature=0.0, top_p=1.0))
        requests = [
            reward_request(decode_response(group[0].token_ids, self.decoder), as_prompt_row(row.fields)["item"])
            for (row, _), group in zip(ready, greedy, strict=True)
        ]
        return [r.score for r in self.runner.score(requests)]

    def close(self) -> None:
        """Stops the reward runner's workers."""
        self.runner.close()


ENV_RETRIES = 2
"""Times a group whose episode is marked for requeue runs again with fresh environments before it is skipped."""


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """A rollout call's multi-turn metrics: mean assistant turns per episode, the calls' tool calls, tool errors,
    tool timeouts and environment failures (an agent's failures among them), the share of response tokens that are
    the environment's, and the black-box agent calls that started a new sample (``prefix_breaks``)."""
    if not episodes:
        return {}
    tokens = sum(len(ep.token_ids) for ep in episodes)
    return {
        "prefix_breaks": float(sum(ep.counters.prefix_breaks for ep in episodes)),
        "turns_mean": sum(ep.counters.turns for ep in episodes) / len(episodes),
        "tool_calls": float(sum(ep.counters.tool_calls for ep in episodes)),
        "tool_errors": float(sum(ep.counters.tool_errors for ep in episodes)),
        "tool_timeouts": float(sum(ep.counters.tool_timeouts for ep in episodes)),
        "env_failures": float(sum(ep.counters.env_failures for ep in episodes)),
        "env_token_frac": sum(ep.counters.env_tokens for ep in episodes) / max(tokens, 1),
    }


def _episode_runner(cfg: RunConfig, engine: RolloutEngine, params: SamplingParams) -> EpisodeRunner | AgentRunner:
    """The runner of ``rollout.env``'s episodes (or ``rollout.agent``'s) on this worker's engine, with the
    checkpoint's tokenizer and chat template and its family's tool parser."""
    from relax_services.agents import (
        AgentConfig,
        AgentRunner,
        EpisodeMedia,
        EpisodeRunner,
        load_agent,
        load_environment,
    )
    from relax_services.models.policy import checkpoint_of

    ckpt = checkpoint_of(cfg.model)
    config = AgentConfig.from_rollout(cfg.rollout)
    if cfg.rollout.agent is not None:
        agent = load_agent(cfg.rollout.agent)
        return AgentRunner(engine, agent, ckpt.tokenizer, ckpt.family, params, config, model=cfg.model.source)
    assert cfg.rollout.env is not None
    env = load_environment(cfg.rollout.env)
    media = EpisodeMedia.of_checkpoint(ckpt) if env.modalities else None  # the environment returns media
    return EpisodeRunner(engine, env, ckpt.tokenizer, ckpt.family, params, config, media)
