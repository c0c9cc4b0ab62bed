"""Reward service: scores responses in batches and adds a ``reward`` field to each sample row.

Scoring goes through relax-core's reward runner (``reward.fn`` or ``reward.name``, routes by ``data_source``,
``reward.timeout_s``). A reward function that raises or times out marks that sample as failed (reward =
``reward.fallback_score``, the reason kept in ``reward_error``, counted in the metrics); it never stops the
batch or the service.

The service runs no model, so its process imports neither torch nor transformers: responses are decoded from the
checkpoint's ``tokenizer.json`` by the ``tokenizers`` library (:class:`~relax_services.models.decoder.ResponseDecoder`,
the same text as the transformers tokenizer).
"""

from __future__ import annotations

from typing import ClassVar

from relax_core import build_reward_runner
from relax_queue import FixedSizeBatcher, Key, QueueClient, QueueTimeoutError
from relax_services.config import RunConfig
from relax_services.models.decoder import Decoder, ResponseDecoder, checkpoint_folder
from relax_services.rows import RewardFields, reward_request
from relax_services.services._base import HealthHandle, ServiceBase

__all__ = ["RewardService", "decode_response"]


def decode_response(token_ids: list[int], tokenizer: Decoder) -> str:
    """Response text as the reward sees it: the checkpoint's tokenizer decodes it, special tokens (the eos among
    them) removed."""
    return tokenizer.decode(token_ids, skip_special_tokens=True)


class RewardService(ServiceBase):
    """Reads ``response`` + ``meta`` of new samples, writes ``reward`` (float) and ``reward_error`` (str|None)."""

    model_stack: ClassVar[bool] = False

    def __init__(
        self,
        name: str,
        cfg: RunConfig,
        sample_queue: QueueClient,
        batch_rows: int = 128,
        *,
        health: HealthHandle | None = None,
    ) -> None:
        super().__init__(name, health)
        self.runner = build_reward_runner(cfg.reward.runner_config())
        self.tokenizer = ResponseDecoder(checkpoint_folder(cfg.model.source, cfg.model.seed))
        self.queue = sample_queue
        self.reader = sample_queue.reader(
            "reward", fields=["response", "meta"], batcher=FixedSizeBatcher(batch_rows, partial=True)
        )

    def step(self) -> None:
        """Score one batch of new responses and add ``reward`` and ``reward_error``."""
        try:
            batch = self.reader.get(timeout=0.5)
        except QueueTimeoutError:
            return
        metas, responses = batch.column("meta"), batch.column("response")
        # A multi-turn episode its environment scored (``env_reward``) keeps that reward; the rest go to reward.fn.
        scored_here = [i for i, meta in enumerate(metas) if "env_reward" not in meta]
        requests = [reward_request(decode_response(responses[i], self.tokenizer), metas[i]) for i in scored_here]
        results = self.runner.score(requests)
        fields: dict[Key, RewardFields] = {
            key: {"reward": float(meta["env_reward"]), "reward_error": None}
            for key, meta in zip(batch.keys, metas, strict=True)
            if "env_reward" in meta
        }
        fields.update(
            {
                batch.keys[i]: {"reward": r.score, "reward_error": r.error}
                for i, r in zip(scored_here, results, strict=True)
            }
        )
        self.queue.add_fields_many(fields)
        self.ack(self.reader, batch)
        failed = sum(not r.ok for r in results)
        timeouts = sum(r.error is not None and r.error.startswith("TimeoutError") for r in results)
        self.record(
            "reward",
            scored=len(fields),
            env_scored=len(fields) - len(results),
            failed=failed,
            timeouts=timeouts,
            last_error=next((r.error for r in reversed(results) if r.error is not None), None),
        )

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the loop, then the reward runner's worker threads and remote clients (once the loop is out)."""
        stopped = super().stop(timeout)
        if stopped:
            self.runner.close()
        return stopped
