"""Reference service: log-probs of each response under the frozen initial policy (for the KL term)."""

from __future__ import annotations

from relax_queue import FixedSizeBatcher, Key, QueueClient, QueueTimeoutError
from relax_services.config import RunConfig
from relax_services.config.trainer_group import single_process
from relax_services.engines import TrainEngine, TrainSample
from relax_services.engines.registry import make_train_engine
from relax_services.rows import ReferenceFields
from relax_services.services._base import HealthHandle, ServiceBase

__all__ = ["ReferenceService"]


class ReferenceService(ServiceBase):
    """Reads ``prompt`` + ``response``, writes ``ref_logprobs`` (one float per response token) for every KL
    estimator. The exact full-vocabulary KL (``algorithm.kl_estimator='full'``) needs the reference's whole
    distributions, which stay out of the queue: the Trainer's engine holds its own frozen reference and sums the
    KL chunk by chunk where the policy's logits are; these log-probs then feed the ``kl`` of the k-estimators'
    diagnostics and the advantage estimators that read them."""

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
        self.queue = sample_queue
        self.reader = sample_queue.reader(
            "reference", fields=["prompt", "response"], batcher=FixedSizeBatcher(batch_rows, partial=True)
        )

    def step(self) -> None:
        """Score one batch of new samples under the reference policy and add ``ref_logprobs``."""
        try:
            batch = self.reader.get(timeout=0.5)
        except QueueTimeoutError:
            return
        samples = [
            TrainSample(prompt=p, response_ids=r)
            for p, r in zip(batch.column("prompt"), batch.column("response"), strict=True)
        ]
        logprobs, _ = self.engine.compute_logprobs(samples)  # [B, L]
        updates: dict[Key, ReferenceFields] = {
            key: {"ref_logprobs": logprobs[i, : len(resp)].tolist()}
            for i, (key, resp) in enumerate(zip(batch.keys, batch.column("response"), strict=True))
        }

        self.queue.add_fields_many(updates)
        self.ack(self.reader, batch)
        self.record("reference", scored=len(samples))
