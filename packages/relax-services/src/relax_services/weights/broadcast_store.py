"""``trainer.weight_sync=broadcast``: the object store for every reader, plus each version broadcast bucket by
bucket from the Trainer to the rollout workers (:mod:`~relax_services.weights.broadcast`; gloo on CPU,
NCCL on GPU).

The Trainer publishes a version by broadcast first, then to the object store, which keeps serving the Eval
service and every rollout worker that is not in the broadcast group: a worker that just (re)started (it
registers, and joins at the next version), or one whose last broadcast broke. A member of the group takes its
versions from the broadcast only. Each rollout worker records which path delivered each version
(``weight_paths`` in its metrics). The rendezvous store is served by the controller's process, so a restarted
Trainer's sender continues the group's generations.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from relax_services.weights import PublishStats, RayWeightStore, WeightStoreActor, WeightUpdate

if TYPE_CHECKING:
    import torch
    from ray.actor import ActorHandle
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    from relax_services.weights.broadcast import BroadcastConfig, BroadcastWeightReceiver, BroadcastWeightSender

__all__ = ["BroadcastWeightStore"]

logger = logging.getLogger(__name__)


class BroadcastWeightStore:
    """:class:`~relax_services.weights.WeightStore` over a :class:`~relax_services.weights.RayWeightStore` plus a
    broadcast to the rollout workers. The handle pickles (address and settings only); each process builds its
    own side on first use: the Trainer a sender, a rollout worker (a handle from :meth:`for_worker`) a receiver
    thread.

    Args:
        inner: The object store every version is also published to.
        address: ``host:port`` of the rendezvous store.
        config: Broadcast group settings (``receivers``: the rollout workers).
        bucket_bytes: Bytes per bucket.
        slot: The rollout worker this handle belongs to (None: the Trainer's or another reader's handle).
    """

    def __init__(
        self,
        inner: RayWeightStore,
        address: str,
        config: BroadcastConfig,
        bucket_bytes: int,
        slot: int | None = None,
    ) -> None:
        self.inner = inner
        self.address = address
        self.config = config
        self.bucket_bytes = bucket_bytes
        self.slot = slot
        self.paths: dict[int, str] = {}
        """``{version: "broadcast" | "object_store"}`` of every version this handle handed out."""
        self._host: TCPStore | None = None
        self._sender: BroadcastWeightSender | None = None
        self._receiver: BroadcastWeightReceiver | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._received: WeightUpdate | None = None

    poll_interval_s = RayWeightStore.poll_interval_s
    """As the object store's: a fetch may fall back to it."""

    @classmethod
    def create(cls, inner: RayWeightStore, config: BroadcastConfig, bucket_bytes: int) -> BroadcastWeightStore:
        """Serves the rendezvous store from this process (the controller's) on a port the OS picks."""
        import ray
        from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, not re-exported

        host = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
        served = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        store = cls(inner, f"{host}:{served.port}", config, bucket_bytes)
        store._host = served
        return store

    def for_worker(self, slot: int) -> BroadcastWeightStore:
        """The handle rollout worker ``slot`` reads through."""
        if not 0 <= slot < self.config.receivers:
            raise ValueError(f"rollout worker {slot} is not in 0..{self.config.receivers - 1}")
        return BroadcastWeightStore(self.inner, self.address, self.config, self.bucket_bytes, slot)

    @property
    def actor(self) -> ActorHandle[WeightStoreActor]:
        """The object store's actor (what a pipeline stops)."""
        return self.inner.actor

    def __reduce__(self) -> tuple[type[BroadcastWeightStore], tuple[object, ...]]:
        # Address and settings only: the receiving process builds its own sender or receiver on first use.
        return (BroadcastWeightStore, (self.inner, self.address, self.config, self.bucket_bytes, self.slot))

    def publish(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> PublishStats:
        """Broadcasts ``version`` to the group's workers, then publishes it to the object store. A failed
        broadcast is logged (those workers read the object store until they re-join), never raised."""
        from relax_services.weights.broadcast import BroadcastWeightSender, WeightSyncError
        from relax_services.weights.buckets import bucket_tensors, pack_bucket

        start = time.perf_counter()
        if self._sender is None:
            self._sender = BroadcastWeightSender(self.address, self.config)
        buckets = (pack_bucket(i, b) for i, b in enumerate(bucket_tensors(state_dict.items(), self.bucket_bytes)))
        try:
            self._sender.send(version, buckets)
        except WeightSyncError as exc:
            logger.warning("%s; they read it from the object store", exc)
        stored = self.inner.publish(version, state_dict)
        return PublishStats(version, stored.num_bytes, time.perf_counter() - start)

    def latest_version(self) -> int | None:
        """Newest version in the object store (every version goes there)."""
        return self.inner.latest_version()

    def fetch(self, have_version: int | None = None) -> WeightUpdate | None:
        """A worker's newest weights: from the broadcast while it is in the group, else from the object store
        (a worker that has not joined yet, or whose last broadcast broke)."""
        if self.slot is None:
            return self.inner.fetch(have_version)
        self._start_receiver()
        assert self._receiver is not None
        with self._lock:
            received = self._received
        if received is not None and (have_version is None or received.version > have_version):
            with self._lock:
                self._received = None
            self.paths[received.version] = "broadcast"
            return received
        if self._receiver.member:
            return None  # the next version comes by broadcast
        update = self.inner.fetch(have_version)
        if update is not None:
            self.paths[update.version] = "object_store"
            logger.info(
                "rollout worker %d: v%d from the object store (not in the broadcast group)", self.slot, update.version
            )
        return update

    def close(self) -> None:
        """Stops this process's receiver thread and leaves the broadcast group (a rebuilt or restarted worker
        registers its slot again; a removed replica's slot stays free)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.config.timeout_s)
        if self._receiver is not None and not (self._thread is not None and self._thread.is_alive()):
            self._receiver.leave()

    def _start_receiver(self) -> None:
        if self._thread is not None:
            return
        from relax_services.weights.broadcast import BroadcastWeightReceiver

        assert self.slot is not None
        self._receiver = BroadcastWeightReceiver(self.address, self.slot, self.config)
        self._thread = threading.Thread(target=self._receive_loop, name=f"weight-broadcast-{self.slot}", daemon=True)
        self._thread.start()

    def _receive_loop(self) -> None:
        from relax_services.weights.broadcast import StateDictSink

        assert self._receiver is not None
        sink = StateDictSink()
        while not self._stop.is_set():
            stats = self._receiver.receive(sink, timeout_s=1.0)
            if stats is not None:
                with self._lock:
                    self._received = WeightUpdate(stats.version, sink.state_dict, stats.seconds)
