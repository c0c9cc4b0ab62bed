"""Reference service: log-probs of each response under the frozen initial policy (for the KL term)."""

from __future__ import annotations

from typing import Any

from relax_queue import FixedSizeBatcher, QueueTimeoutError
from relax_services._policy import build_train_engine
from relax_services.config import RunConfig
from relax_services.engines import TrainSample
from relax_services.services._base import ServiceBase

__all__ = ["ReferenceService"]


class ReferenceService(ServiceBase):
    """Reads ``prompt`` + ``response``, writes ``ref_logprobs`` (one float per response token)."""

    def __init__(
        self, name: str, cfg: RunConfig, sample_queue: Any, batch_rows: int = 64, *, health: Any = None
    ) -> None:
        super().__init__(name, health)
        self.engine = build_train_engine(cfg)
        self.queue = sample_queue
        self.reader = sample_queue.reader(
            "reference", fields=["prompt", "response"], batcher=FixedSizeBatcher(batch_rows, partial=True)
        )

    def step(self) -> None:
        try:
            batch = self.reader.get(timeout=0.5)
        except QueueTimeoutError:
            return
        samples = [
            TrainSample(prompt=p, response_ids=r)
            for p, r in zip(batch.column("prompt"), batch.column("response"), strict=True)
        ]
        logprobs, _ = self.engine.compute_logprobs(samples)  # [B, L_max]
        updates = {
            key: {"ref_logprobs": logprobs[i, : len(resp)].tolist()}
            for i, (key, resp) in enumerate(zip(batch.keys, batch.column("response"), strict=True))
        }
        self.queue.add_fields_many(updates)
        self.ack(self.reader, batch)
        self.record("reference", scored=len(samples))
