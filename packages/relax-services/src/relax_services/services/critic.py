"""Critic service: values of each response under the newest critic the Trainer published (PPO only)."""

from __future__ import annotations

from relax_queue import FixedSizeBatcher, Key, QueueClient, QueueTimeoutError
from relax_services.config import RunConfig
from relax_services.engines import TrainSample
from relax_services.engines.torch import build_value_engine
from relax_services.rows import CriticFields
from relax_services.services._base import HealthHandle, ServiceBase
from relax_services.weights import WeightPoller, WeightStore

__all__ = ["CriticService"]


class CriticService(ServiceBase):
    """Reads ``prompt`` + ``response``, writes ``values`` (one float per response token) and ``value_version``.

    The Trainer trains the critic alongside the policy and publishes its weights with the same version; this
    service pulls the newest at safe points (between batches). Before scoring it catches up to the version the
    trainer has published, so at τ = 0 every value comes from the critic of the policy that drew the sample.
    """

    def __init__(
        self,
        name: str,
        cfg: RunConfig,
        sample_queue: QueueClient,
        critic_weights: WeightStore,
        batch_rows: int = 128,
        *,
        health: HealthHandle | None = None,
    ) -> None:
        super().__init__(name, health)
        self.engine = build_value_engine(cfg, role="critic")
        self.queue = sample_queue
        self.critic_version = -1
        self._poll = WeightPoller(critic_weights, lambda: self.critic_version)
        self.reader = sample_queue.reader(
            "critic", fields=["prompt", "response"], batcher=FixedSizeBatcher(batch_rows, partial=True)
        )
        self._sync_weights()

    def _sync_weights(self) -> None:
        newer = self._poll()
        if newer is not None:
            self.critic_version, state = newer
            self.engine.model.load_state_dict(state)

    def step(self) -> None:
        """Score one batch of new samples with the newest critic (caught up to the trainer's version); add
        ``values``."""
        try:
            batch = self.reader.get(timeout=0.5)
        except QueueTimeoutError:
            self._sync_weights()
            return
        self.catch_up(self.queue.version, lambda: self.critic_version, self._sync_weights, self.reader, batch)
        responses = batch.column("response")
        samples = [
            TrainSample(prompt=p, response_ids=r) for p, r in zip(batch.column("prompt"), responses, strict=True)
        ]
        values, _ = self.engine.compute_values(samples)  # [B, L_max]
        updates: dict[Key, CriticFields] = {
            key: {"values": values[i, : len(resp)].tolist(), "value_version": self.critic_version}
            for i, (key, resp) in enumerate(zip(batch.keys, responses, strict=True))
        }
        self.queue.add_fields_many(updates)
        self.ack(self.reader, batch)
        self.record("critic", scored=len(samples), version=self.critic_version)
