"""Reference service: log-probs of each response under the frozen initial policy (for the KL term)."""

from __future__ import annotations

import torch

from relax_queue import FixedSizeBatcher, Key, QueueClient, QueueTimeoutError
from relax_services.config import RunConfig
from relax_services.config.trainer_group import single_process
from relax_services.engines import TrainEngine, TrainSample
from relax_services.engines.registry import make_train_engine
from relax_services.rows import ReferenceFields
from relax_services.services._base import HealthHandle, ServiceBase

__all__ = ["ReferenceService"]


class ReferenceService(ServiceBase):
    """Reads ``prompt`` + ``response``, writes ``ref_logprobs`` (one float per response token) and, for the
    full-vocabulary KL (``algorithm.kl_estimator='full'``), ``ref_dist`` (``[L, V]`` float32 log-probs per row,
    a numpy array)."""

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
        # The trainer's engine kind, frozen at the initial weights; one process even when the Trainer is a group.
        self.engine: TrainEngine = make_train_engine(single_process(cfg), role="reference")
        self.full_dist = cfg.algorithm.kl_estimator == "full"
        self.queue = sample_queue
        self.reader = sample_queue.reader(
            "reference", fields=["prompt", "response"], batcher=FixedSizeBatcher(batch_rows, partial=True)
        )

    def step(self) -> None:
        """Score one batch of new samples under the reference policy and add ``ref_logprobs`` (and ``ref_dist``)."""
        try:
            batch = self.reader.get(timeout=0.5)
        except QueueTimeoutError:
            return
        samples = [
            TrainSample(prompt=p, response_ids=r)
            for p, r in zip(batch.column("prompt"), batch.column("response"), strict=True)
        ]
        scores = self.engine.compute_scores(samples, with_dist=self.full_dist)
        updates: dict[Key, ReferenceFields] = {}
        for i, (key, resp) in enumerate(zip(batch.keys, batch.column("response"), strict=True)):
            updates[key] = {"ref_logprobs": scores.logprobs[i, : len(resp)].tolist()}
            if self.full_dist:
                assert scores.dist is not None, "a policy engine scores whole distributions"
                # [L, V] as numpy: it pickles ~4x faster than a tensor at every queue hop
                updates[key]["ref_dist"] = scores.dist[i, : len(resp)].to("cpu", torch.float32).numpy().copy()

        self.queue.add_fields_many(updates)
        self.ack(self.reader, batch)
        self.record("reference", scored=len(samples))
