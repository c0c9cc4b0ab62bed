"""Rollout service: reads prompt rows, generates a group of completions per prompt with the newest weights,
and writes one sample row per completion into the sample queue."""

from __future__ import annotations

import hashlib
import time

from relax_queue import Batch, FixedSizeBatcher, QueueClient, QueueTimeoutError, Row, RowInput
from relax_services.config import RunConfig
from relax_services.data.prompts import PromptBuilder
from relax_services.engines import RolloutEngine
from relax_services.engines.registry import make_rollout_engine
from relax_services.engines.sampling import sampling_params
from relax_services.models import OmniPrompt
from relax_services.rows import RolloutFields, SampleMeta, as_prompt_row, as_record_row, item_extras, sample_key
from relax_services.services._base import HealthHandle, ServiceBase
from relax_services.weights import WeightPoller, WeightStore
from relax_services.weights.broadcast_store import BroadcastWeightStore

__all__ = ["RolloutService", "sampling_seed"]


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
        self._sync_weights()  # a (re)started worker begins from the newest published weights

    def _paths(self) -> dict[int, str]:
        """``{version: path}`` of the versions fetched since the last record (the broadcast store tells them)."""
        return self.weights.paths if isinstance(self.weights, BroadcastWeightStore) else self._no_paths

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the loop, then the broadcast receiver's thread when there is one."""
        stopped = super().stop(timeout)
        if isinstance(self.weights, BroadcastWeightStore):
            self.weights.close()
        return stopped

    def _sync_weights(self) -> None:
        newer = self._poll()
        if newer is not None:
            start = time.perf_counter()
            self.engine.load_weights(newer[1], newer[0])
            self._load_s[newer[0]] = time.perf_counter() - start

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

    def step(self) -> None:
        """Generate one batch of prompt groups with the newest weights, put their sample rows, ack the prompts."""
        try:
            batch = self.reader.get(timeout=0.5)
        except QueueTimeoutError:
            self._sync_weights()
            return
        self._catch_up(batch)
        ready = self._ready_prompts(batch)
        keys = [str(row.key) for row, _ in ready]
        self.engine.seed(sampling_seed(self.cfg.trainer.seed, keys))
        start = time.perf_counter()
        groups = self.engine.generate([p for _, p in ready], self.params, poll_weights=self._poll) if ready else []
        elapsed = time.perf_counter() - start
        rows = []
        for (row, prompt), completions in zip(ready, groups, strict=True):
            item = as_prompt_row(row.fields)["item"]
            meta: SampleMeta = {"task": item["task"], "answer": item["answer"], "prompt_key": str(row.key)}
            meta.update(item_extras(item))  # type: ignore[typeddict-item]  # the optional keys of both
            for j, completion in enumerate(completions):
                fields: RolloutFields = {
                    "prompt": prompt,
                    "meta": meta,
                    "response": completion.token_ids,
                    "logprobs": completion.logprobs,
                    "token_versions": completion.versions,
                    "loss_mask": completion.loss_mask,  # env/tool tokens of a multi-turn episode are 0
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
            self.sample_queue.put_many(rows, admitted=True, timeout=None)
        self.ack(self.reader, batch)
        self.record(
            "rollout",
            prompts=len(batch),
            samples=len(rows),
            tokens=sum(len(c.token_ids) for group in groups for c in group),
            seconds=elapsed,
            version=self.engine.version,
            weight_sync_s=dict(self._poll.sync_seconds),
            weight_load_s=dict(self._load_s),
            weight_paths=dict(self._paths()),
        )
        self._poll.sync_seconds.clear()
        self._load_s.clear()
        self._paths().clear()
