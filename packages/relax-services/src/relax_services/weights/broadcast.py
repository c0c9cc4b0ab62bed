"""Weight sync by ``torch.distributed`` broadcast: trainer rank 0 sends each packed bucket once over a process
group that spans it and the rollout workers (gloo on CPU, NCCL on GPU), and every worker receives it into a
sink (a :class:`~relax_services.weights.buckets.BucketLoader` or a :class:`StateDictSink`).

The group is not the trainer's own (FSDP) process group: it is built directly on a ``TCPStore`` as a
``ProcessGroupGloo`` / ``ProcessGroupNCCL`` of ``1 + members`` ranks (sender rank 0), so workers can come and go
without touching the trainer's group. Membership changes by *generation*, agreed through the store:

- a worker (re)starting registers its slot (``join/{slot}``, a counter: its incarnation) and bumps ``joins``;
- before a version, the sender re-forms the group when ``joins`` changed or the last broadcast failed: it
  proposes generation ``g`` (key ``gen``), waits up to ``join_window_s`` for an answer from every slot that ever
  registered, and names the members that answered (``gen/{g}/members``); they build generation ``g``'s group;
- each version is announced in the store (``gen/{g}/v/{n}``) before its buckets are broadcast, so a worker
  enters a collective only for a version that is being sent, and between versions it only polls the store,
  where it sees a new generation.

A restarted worker therefore re-joins at the next version. A worker that dies in the middle of a version breaks
that version's broadcast: the sender raises :class:`WeightSyncError` (the version reached no worker whole; no
sink shows part of it when it is a :class:`StateDictSink`), and the next version re-forms the group without the
dead worker. A survivor blocked in the broken broadcast fails after ``timeout_s`` and registers again.

Per bucket the wire carries three broadcasts: ``meta`` (int64 ``[kind, version, header bytes, buffer bytes]``),
the header (UTF-8 JSON of the bucket's tensor specs) and the buffer; ``kind`` 0 ends a version.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, Protocol, cast

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]  # public, not re-exported

from relax_services.weights.buckets import PackedBucket, SyncStats, TensorSpec, log_sync

__all__ = [
    "BroadcastConfig",
    "BroadcastWeightReceiver",
    "BroadcastWeightSender",
    "BucketSink",
    "StateDictSink",
    "WeightSyncError",
]

logger = logging.getLogger(__name__)

_BUCKET, _END = 1, 0


@dataclass(frozen=True)
class BroadcastConfig:
    """Settings of the broadcast group.

    Attributes:
        receivers: Slots a worker may register under (``0 .. receivers - 1``; one per rollout worker).
        backend: ``"gloo"`` (CPU tensors), ``"nccl"`` (CUDA tensors; every member needs a GPU) or ``"auto"``
            (NCCL when CUDA is available).
        timeout_s: A broadcast or group start not completed by every member within this many seconds fails.
        join_window_s: How long re-forming the group waits for every registered slot to answer (a dead worker
            never does; the window bounds what it costs).
        poll_interval_s: How often a waiting worker reads the store.
    """

    receivers: int = 1
    backend: Literal["gloo", "nccl", "auto"] = "auto"
    timeout_s: float = 60.0
    join_window_s: float = 10.0
    poll_interval_s: float = 0.01

    def __post_init__(self) -> None:
        if self.receivers < 1:
            raise ValueError(f"BroadcastConfig.receivers must be >= 1, got {self.receivers}")
        if self.backend not in ("gloo", "nccl", "auto"):
            raise ValueError(f"BroadcastConfig.backend must be 'gloo', 'nccl' or 'auto', got {self.backend!r}")
        for name in ("timeout_s", "join_window_s", "poll_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"BroadcastConfig.{name} must be > 0, got {getattr(self, name)}")

    @property
    def resolved_backend(self) -> Literal["gloo", "nccl"]:
        """The backend in use (``auto`` resolved in this process)."""
        if self.backend == "auto":
            return "nccl" if torch.cuda.is_available() else "gloo"
        return self.backend

    @property
    def device(self) -> torch.device:
        """Where the broadcast tensors live: the current CUDA device with NCCL, else CPU."""
        if self.resolved_backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


class WeightSyncError(RuntimeError):
    """A version's broadcast failed; no worker received it whole, and the next version re-forms the group."""


class BucketSink(Protocol):
    """Receives one version bucket by bucket (:class:`~relax_services.weights.buckets.BucketLoader` is
    one)."""

    def begin(self) -> None:
        """A new version starts; what earlier buckets of a broken version left is dropped."""
        ...

    def apply(self, bucket: PackedBucket) -> None:
        """One bucket of the version, in order."""
        ...

    def finish(self) -> None:
        """Every bucket of the version arrived: it may replace the last complete one."""
        ...


class StateDictSink:
    """A :class:`BucketSink` that copies each bucket's tensors to CPU and exposes a version only once it
    arrived whole (a version broken mid-stream never replaces the last complete one).

    Attributes:
        state_dict: The last complete version's tensors (empty before the first).
    """

    def __init__(self) -> None:
        self.state_dict: dict[str, torch.Tensor] = {}
        self._pending: dict[str, torch.Tensor] = {}

    def begin(self) -> None:
        """Starts collecting a new version (a half-received one is dropped)."""
        self._pending = {}

    def apply(self, bucket: PackedBucket) -> None:
        """Copies the bucket's tensors to CPU into the pending version."""
        for spec in bucket.specs:
            raw = bucket.buffer[spec.offset : spec.offset + spec.num_bytes]
            self._pending[spec.name] = raw.view(spec.dtype).reshape(spec.shape).to("cpu", copy=True)

    def finish(self) -> None:
        """The pending version is complete: it becomes :attr:`state_dict`."""
        self.state_dict, self._pending = self._pending, {}


def _store(address: str, is_master: bool, timeout_s: float) -> TCPStore:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"weight sync store address must be 'host:port', got {address!r}")
    return TCPStore(host, int(port), is_master=is_master, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


class _Group(Protocol):
    """What this module uses of a ``ProcessGroupGloo`` / ``ProcessGroupNCCL``."""

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> dist.Work: ...


def _new_group(config: BroadcastConfig, store: TCPStore, generation: int, rank: int, size: int) -> _Group:
    """Generation ``generation``'s process group (blocks until every member has built it, or ``timeout_s``)."""
    prefix = PrefixStore(f"pg/{generation}", store)
    timeout = timedelta(seconds=config.timeout_s)
    if config.resolved_backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return cast(_Group, dist.ProcessGroupNCCL(prefix, rank, size, options))  # its stubs overload broadcast
    return cast(_Group, dist.ProcessGroupGloo(prefix, rank, size, timeout))


def _broadcast(group: _Group | None, tensor: torch.Tensor) -> None:
    if group is None:
        raise RuntimeError("no broadcast group")
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def _header(bucket: PackedBucket) -> bytes:
    specs = [[s.name, str(s.dtype).removeprefix("torch."), list(s.shape), s.offset, s.num_bytes] for s in bucket.specs]
    return json.dumps([bucket.index, specs]).encode()


def _specs(header: bytes) -> tuple[int, tuple[TensorSpec, ...]]:
    index, specs = json.loads(header.decode())
    return int(index), tuple(TensorSpec(n, getattr(torch, d), tuple(shape), o, b) for n, d, shape, o, b in specs)


class BroadcastWeightSender:
    """The trainer side (rank 0): a :class:`~relax_services.weights.buckets.WeightStream` over a
    broadcast group of the registered workers.

    Args:
        address: ``host:port`` of the rendezvous store; with ``host_store`` port 0 lets the OS pick one
            (:attr:`address` is then the bound one).
        config: Group settings.
        host_store: Serve the store from this process (else connect to one served elsewhere, e.g. by a
            controller that outlives trainer restarts; the generation count continues from the store).
    """

    def __init__(self, address: str, config: BroadcastConfig | None = None, *, host_store: bool = False) -> None:
        self.config = config or BroadcastConfig()
        self.store = _store(address, host_store, self.config.timeout_s)
        self.address = f"{address.rpartition(':')[0]}:{self.store.port}"
        self.members: tuple[int, ...] = ()
        """Slots of the current generation's members, in rank order (rank = position + 1)."""
        self._generation = int(self.store.get("gen")) if self.store.check(["gen"]) else 0
        self._group: _Group | None = None
        self._joins_seen = -1
        self._broken = True
        self._seq = 0

    def registered(self) -> list[int]:
        """Slots a worker has registered under (alive or not)."""
        return [s for s in range(self.config.receivers) if self.store.check([f"join/{s}"])]

    def send(self, version: int, buckets: Iterable[PackedBucket]) -> SyncStats:
        """Broadcasts every bucket of ``version`` to the members (re-forming the group first when a worker
        registered since the last version or the last one failed). The buckets are always drained: on a
        sharded trainer their gathering is collective over every trainer rank.

        Raises:
            WeightSyncError: The group could not be formed or a broadcast failed (names the version and cause).
        """
        start = time.perf_counter()
        failure: str | None = None
        try:
            self._regroup_if_needed()
        except RuntimeError as exc:  # a member that answered died before the group was built
            failure = f"forming generation {self._generation}: {type(exc).__name__}: {exc}"
            self._broken = True
        deliver = failure is None and self._group is not None
        if deliver:
            self.store.set(f"gen/{self._generation}/v/{self._seq}", str(version))
            self._seq += 1
        num_bytes = num_buckets = 0
        for bucket in buckets:
            num_bytes += bucket.num_bytes
            num_buckets += 1
            if deliver:
                try:
                    self._send_bucket(version, bucket)
                except RuntimeError as exc:  # gloo/NCCL errors (a dead member, a timeout) are RuntimeErrors
                    failure = f"bucket {bucket.index}: {type(exc).__name__}: {exc}"
                    deliver = False
                    self._drop_group()
        if deliver:
            try:
                _broadcast(self._group, torch.tensor([_END, version, 0, 0], device=self.config.device))
            except RuntimeError as exc:
                failure = f"end of version: {type(exc).__name__}: {exc}"
                self._drop_group()
        if failure is not None:
            raise WeightSyncError(
                f"weight sync v{version} to workers {list(self.members)} failed ({failure}); no worker received it "
                "whole, the next version re-forms the group without the workers that no longer answer"
            )
        stats = SyncStats(version, num_bytes, num_buckets, time.perf_counter() - start)
        log_sync(stats, f" to {len(self.members)} worker(s) by {self.config.resolved_backend} broadcast")
        return stats

    def close(self) -> None:
        """Drops the group (the store stays served while this object lives)."""
        self._group, self.members = None, ()

    def _drop_group(self) -> None:
        """Marks the group broken and releases it: its connections close, so members blocked in a broadcast of
        it fail now rather than after ``timeout_s``. ``members`` keeps naming the workers of the broken version."""
        self._group, self._broken = None, True

    def _send_bucket(self, version: int, bucket: PackedBucket) -> None:
        device = self.config.device
        header = _header(bucket)
        _broadcast(self._group, torch.tensor([_BUCKET, version, len(header), bucket.buffer.numel()], device=device))
        _broadcast(self._group, torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device))
        _broadcast(self._group, bucket.buffer.to(device))

    def _regroup_if_needed(self) -> None:
        joins = int(self.store.add("joins", 0))
        if not self._broken and joins == self._joins_seen:
            return
        self._joins_seen = joins
        self._group, self.members = None, ()
        self._generation += 1
        g = self._generation
        self.store.set("gen", str(g))
        candidates = self.registered()
        deadline = time.monotonic() + self.config.join_window_s
        answered: list[int] = []
        while True:
            answered = [s for s in candidates if self.store.check([f"gen/{g}/ack/{s}"])]
            if len(answered) == len(candidates) or time.monotonic() > deadline:
                break
            time.sleep(self.config.poll_interval_s)
        self.store.set(f"gen/{g}/members", ",".join(map(str, answered)))
        missing = sorted(set(candidates) - set(answered))
        if missing:
            logger.warning("weight sync generation %d: workers %s did not answer; sending without them", g, missing)
        self._seq, self._broken = 0, False
        if answered:
            self._group = _new_group(self.config, self.store, g, 0, 1 + len(answered))
            self.members = tuple(answered)


class BroadcastWeightReceiver:
    """A rollout worker's side: registers ``slot`` and receives versions from :class:`BroadcastWeightSender`.

    Args:
        address: ``host:port`` of the sender's rendezvous store.
        slot: This worker's slot (``0 .. config.receivers - 1``); a restarted worker registers the same slot.
        config: Group settings (the sender's).
    """

    def __init__(self, address: str, slot: int, config: BroadcastConfig | None = None) -> None:
        self.config = config or BroadcastConfig()
        if not 0 <= slot < self.config.receivers:
            raise ValueError(f"slot {slot} is not in 0..{self.config.receivers - 1} (BroadcastConfig.receivers)")
        self.slot = slot
        self.store = _store(address, False, self.config.timeout_s)
        self._group: _Group | None = None
        self._generation = 0
        self._seq = 0
        self.incarnation = 0
        self._register()

    @property
    def member(self) -> bool:
        """Whether this worker is in the current generation's group (its next version comes by broadcast)."""
        return self._group is not None

    def receive(self, sink: BucketSink, timeout_s: float) -> SyncStats | None:
        """Waits up to ``timeout_s`` for the next version and delivers it into ``sink``; ``None`` if none came.
        A version whose broadcast breaks is dropped (``sink.finish`` is not called) and the worker registers
        again, to be in the next generation."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            newest = int(self.store.get("gen")) if self.store.check(["gen"]) else 0
            if newest > self._generation:
                self._enter(newest)
                continue
            key = f"gen/{self._generation}/v/{self._seq}"
            if self._group is not None and self.store.check([key]):
                self._seq += 1
                version = int(self.store.get(key))
                try:
                    return self._receive(version, sink)
                except (RuntimeError, ValueError) as exc:
                    logger.warning(
                        "weight sync v%d broke on worker %d (%s); registering again", version, self.slot, exc
                    )
                    self._group = None
                    self._register()
                    continue
            time.sleep(self.config.poll_interval_s)
        return None

    def leave(self) -> None:
        """Leave the group for good (a replica removed by ``relax scale``): the slot is no longer registered, so the
        sender's next generation neither waits for it nor counts on it."""
        self._group = None
        self.store.delete_key(f"join/{self.slot}")
        self.store.add("joins", 1)

    def _register(self) -> None:
        # The generation is read before registering: every proposal made after the registration is newer.
        self._generation = int(self.store.get("gen")) if self.store.check(["gen"]) else 0
        self.incarnation = int(self.store.add(f"join/{self.slot}", 1))
        self.store.add("joins", 1)

    def _enter(self, generation: int) -> None:
        """Answers proposal ``generation`` and builds its group if named a member. Once answered, it waits for
        the member list whatever the caller's timeout (the sender counts on every member that answered); the
        sender names it within ``join_window_s``."""
        self._generation, self._group, self._seq = generation, None, 0
        deadline = time.monotonic() + self.config.join_window_s + self.config.timeout_s
        self.store.set(f"gen/{generation}/ack/{self.slot}", str(self.incarnation))
        key = f"gen/{generation}/members"
        while not self.store.check([key]):
            if time.monotonic() > deadline or self.store.get("gen") != str(generation).encode():
                self._register()  # the proposal was abandoned or overtaken: be in the next one
                return
            time.sleep(self.config.poll_interval_s)
        text = self.store.get(key).decode()
        members: Sequence[int] = [int(s) for s in text.split(",")] if text else []
        if self.slot not in members:  # answered too late: register again for the next generation
            self._register()
            return
        try:
            rank = members.index(self.slot) + 1
            self._group = _new_group(self.config, self.store, generation, rank, 1 + len(members))
        except RuntimeError as exc:
            logger.warning("weight sync generation %d: worker %d could not join (%s)", generation, self.slot, exc)
            self._register()

    def _receive(self, version: int, sink: BucketSink) -> SyncStats:
        start = time.perf_counter()
        device = self.config.device
        sink.begin()
        num_bytes = num_buckets = 0
        while True:
            meta = torch.zeros(4, dtype=torch.int64, device=device)
            _broadcast(self._group, meta)
            kind, sent_version, header_len, buffer_len = (int(v) for v in meta.tolist())
            if sent_version != version:
                raise ValueError(f"announced version {version}, the stream carries {sent_version}")
            if kind == _END:
                break
            header = torch.empty(header_len, dtype=torch.uint8, device=device)
            _broadcast(self._group, header)
            buffer = torch.empty(buffer_len, dtype=torch.uint8, device=device)
            _broadcast(self._group, buffer)
            index, specs = _specs(header.cpu().numpy().tobytes())
            bucket = PackedBucket(index, buffer, specs)
            sink.apply(bucket)
            num_bytes += bucket.num_bytes
            num_buckets += 1
        sink.finish()
        stats = SyncStats(version, num_bytes, num_buckets, time.perf_counter() - start)
        log_sync(stats, f" received by worker {self.slot}")
        return stats
