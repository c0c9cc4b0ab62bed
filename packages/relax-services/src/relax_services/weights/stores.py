"""Versioned weight store: the trainer publishes each policy version once; rollout and critic pull the newest.

Two implementations of one :class:`WeightStore` protocol:

- :class:`InProcessWeightStore`: CPU snapshots behind a lock, for tests and the colocated mode's one process; with
  ``recycle`` (``run.reuse_weight_buffers`` in a run) a publication is copied into the buffers of a retired version
  that no reader uses any more.
- :class:`RayWeightStore`: a handle on a named Ray actor (``num_cpus=0``) that keeps the object-store
  references of the newest ``keep`` versions (1 in a run: only the newest is kept alive, plus the versions
  readers still compute with). The publisher ``ray.put``s the state dict once as numpy buffers (so the
  publishing process owns the object); readers ask the actor for the newest reference and get tensors that
  view the object store's shared memory (:mod:`~relax_services.weights.packed`: one copy per node, not per
  reader). If the publisher dies, its objects are lost: readers get ``None`` until the restarted trainer
  publishes again (after :meth:`~RayWeightStore.rollback` to the version of the checkpoint it resumed from).

A GPU backend (NCCL broadcast from trainer to rollout ranks) implements the same protocol later:
``publish`` broadcasts, ``fetch`` receives into a preallocated buffer. Every publish and fetch measures
its own wall time and returns it, so the services can log sync time per version.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, cast, runtime_checkable

if TYPE_CHECKING:  # torch is not imported at runtime: the store actor's process never needs it
    import torch
    from ray import ObjectRef
    from ray.actor import ActorHandle

    from relax_services.weights.packed import PackedWeights

_Item = TypeVar("_Item")

StateDict = dict[str, "torch.Tensor"]


@dataclass(frozen=True)
class PublishStats:
    """One publication.

    Attributes:
        version: Policy version published.
        num_bytes: Bytes of tensor data.
        seconds: Wall time from the call to the version being visible to readers.
    """

    version: int
    num_bytes: int
    seconds: float


@dataclass(frozen=True)
class WeightUpdate:
    """Weights handed to a reader.

    Attributes:
        version: Policy version of ``state_dict``.
        state_dict: CPU tensors; treat as read-only (they may be shared with other readers).
        seconds: Wall time of the fetch (the reader's sync time for this version).
    """

    version: int
    state_dict: StateDict
    seconds: float


@runtime_checkable
class WeightStore(Protocol):
    """Versioned weights: one writer publishes increasing versions, any number of readers fetch the newest."""

    def publish(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> PublishStats:
        """Makes ``version`` the newest; versions must strictly increase.

        Raises:
            ValueError: If ``version`` is not newer than the newest published one.
        """
        ...

    def latest_version(self) -> int | None:
        """Newest published version, ``None`` before the first publish."""
        ...

    def fetch(self, have_version: int | None = None) -> WeightUpdate | None:
        """The newest weights, or ``None`` if nothing newer than ``have_version`` exists."""
        ...


def state_dict_bytes(state_dict: Mapping[str, torch.Tensor]) -> int:
    """Bytes of tensor data in ``state_dict``."""
    return sum(t.numel() * t.element_size() for t in state_dict.values())


def _distinct_bytes(state_dict: Mapping[str, torch.Tensor]) -> int:
    """Bytes of tensor data, each tensor object once (a snapshot's tied names share one)."""
    return state_dict_bytes({str(id(t)): t for t in state_dict.values()})


def cpu_copy(state_dict: Mapping[str, torch.Tensor]) -> StateDict:
    """Detached CPU copies (never views of the live parameters)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in state_dict.items()}


class _Versions(Generic[_Item]):
    """Newest-``keep`` bookkeeping shared by both stores (items: state dicts in process, object refs in the actor)."""

    def __init__(self, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self.items: OrderedDict[int, _Item] = OrderedDict()

    def check_newer(self, version: int) -> None:
        newest = next(reversed(self.items), None)
        if newest is not None and version <= newest:
            raise ValueError(f"weight version {version} is not newer than the published version {newest}")

    def add(self, version: int, item: _Item) -> list[_Item]:
        """Adds ``version``; returns the items it pushed out, oldest first."""
        self.check_newer(version)
        self.items[version] = item
        dropped = []
        while len(self.items) > self.keep:
            dropped.append(self.items.popitem(last=False)[1])
        return dropped

    def rollback(self, version: int) -> list[int]:
        dropped = [v for v in self.items if v > version]
        for v in dropped:
            del self.items[v]
        return dropped

    def newest(self, have_version: int | None) -> tuple[int, _Item] | None:
        if not self.items:
            return None
        version = next(reversed(self.items))
        if have_version is not None and have_version >= version:
            return None
        return version, self.items[version]


class InProcessWeightStore:
    """:class:`WeightStore` in one process; thread-safe.

    A version is a CPU snapshot (tied tensors once) that readers compute with in place. With ``recycle`` the
    snapshot of the version that last left the store is kept as a spare and the next publication is copied into
    it when no tensor of the process references its bytes any more (:mod:`~relax_services.weights._snapshots`):
    no page is touched for the first time, so a publication costs about a plain memory copy instead of ~5× one
    (``benchmarks/weight_publish.py``). The trade: between publications the spare is one more copy of the weights
    in memory (none while a reader still computes with that version); at the publication itself the peak is the
    same two copies (the readers' version and the new one) as with fresh allocations.

    Args:
        keep: Versions retained (older ones are dropped as new ones arrive).
        recycle: Reuse the spare's buffers; ``False`` allocates every version afresh.

    Attributes:
        recycled: Publications written into a spare's buffers.
    """

    poll_interval_s = 0.0
    """How often a reader should ask for a newer version: asking is a locked dict lookup, so always."""

    def __init__(self, keep: int = 2, recycle: bool = True) -> None:
        self._versions: _Versions[StateDict] = _Versions(keep)
        self._lock = threading.Lock()
        self._recycle = recycle
        self._spare: StateDict | None = None
        self.recycled = 0

    def publish(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> PublishStats:
        """Stores a CPU snapshot of ``state_dict`` as ``version`` (in the spare's buffers when nothing uses them)."""
        from relax_services.weights._snapshots import reusable, snapshot

        start = time.perf_counter()
        with self._lock:
            self._versions.check_newer(version)
            spare, self._spare = self._spare, None  # only the publisher touches the spare
        into = spare if spare is not None and reusable(spare, state_dict) else None
        del spare  # one that cannot be reused goes (a reader that still holds it keeps it)
        copy = snapshot(state_dict, into)
        with self._lock:
            dropped = self._versions.add(version, copy)
            if self._recycle and dropped:
                self._spare = dropped[-1]
        self.recycled += into is not None
        return PublishStats(version, _distinct_bytes(copy), time.perf_counter() - start)

    def latest_version(self) -> int | None:
        """Newest published version."""
        with self._lock:
            newest = self._versions.newest(None)
        return None if newest is None else newest[0]

    def fetch(self, have_version: int | None = None) -> WeightUpdate | None:
        """Newest weights if newer than ``have_version``: new tensor objects over the version's bytes, so that
        whatever a reader keeps of them is seen before the bytes are reused."""
        from relax_services.weights._snapshots import views

        start = time.perf_counter()
        with self._lock:  # views made under the lock: the version cannot become a spare before they count
            newest = self._versions.newest(have_version)
            if newest is None:
                return None
            update = WeightUpdate(newest[0], views(newest[1]), 0.0)
        return replace(update, seconds=time.perf_counter() - start)

    def versions(self) -> list[int]:
        """Retained versions, oldest first."""
        with self._lock:
            return list(self._versions.items)

    def rollback(self, version: int) -> list[int]:
        """Drops versions newer than ``version`` (a trainer resumed from an older checkpoint); returns them."""
        with self._lock:
            return self._versions.rollback(version)


class WeightStoreActor:
    """Body of the Ray actor behind :class:`RayWeightStore`: keeps object refs of the newest versions.

    References arrive wrapped in a list so that Ray passes the reference itself, not the resolved weights.
    """

    def __init__(self, keep: int = 2) -> None:
        self._versions: _Versions[list[ObjectRef[PackedWeights]]] = _Versions(keep)
        self._history: list[dict[str, float]] = []

    def register(
        self, version: int, boxed_ref: list[ObjectRef[PackedWeights]], num_bytes: int, put_seconds: float
    ) -> None:
        """Makes the object ``boxed_ref[0]`` the newest version."""
        self._versions.add(version, boxed_ref)
        self._history.append({"version": float(version), "num_bytes": float(num_bytes), "put_s": put_seconds})

    def newest(self, have_version: int | None) -> tuple[int, list[ObjectRef[PackedWeights]]] | None:
        """``(version, [ref])`` of the newest version if newer than ``have_version``."""
        return self._versions.newest(have_version)

    def latest_version(self) -> int | None:
        """Newest registered version."""
        newest = self._versions.newest(None)
        return None if newest is None else int(newest[0])

    def versions(self) -> list[int]:
        """Retained versions, oldest first."""
        return list(self._versions.items)

    def rollback(self, version: int) -> list[int]:
        """Drops versions newer than ``version``; returns them."""
        return self._versions.rollback(version)

    def history(self) -> list[dict[str, float]]:
        """One record per publication: version, bytes, publisher-side put time."""
        return list(self._history)


class RayWeightStore:
    """:class:`WeightStore` over a named Ray actor; the handle pickles, so services pass it around.

    Build it with :meth:`create` (driver or controller) or :meth:`connect` (any process of the cluster).

    Args:
        actor: Handle of a :class:`WeightStoreActor` actor.
    """

    poll_interval_s = 0.05
    """How often a reader should ask for a newer version: every ask is an actor round trip, so a few tens of
    milliseconds keep polling off a rollout's decode path."""

    def __init__(self, actor: ActorHandle[WeightStoreActor]) -> None:
        self._actor = actor

    @classmethod
    def create(
        cls, name: str = "relax-weights", keep: int = 2, namespace: str | None = None, detached: bool = False
    ) -> RayWeightStore:
        """Starts the named store actor (``num_cpus=0``), or returns a handle on it if it already runs.

        Args:
            name: Actor name readers connect by.
            keep: Versions whose objects stay referenced.
            namespace: Ray namespace (default: the job's).
            detached: Outlive the creating driver.
        """
        import ray

        options: dict[str, Any] = {"name": name, "get_if_exists": True, "num_cpus": 0}
        if namespace is not None:
            options["namespace"] = namespace
        if detached:
            options["lifetime"] = "detached"
        actor = ray.remote(WeightStoreActor).options(**options).remote(keep)
        return cls(cast("ActorHandle[WeightStoreActor]", actor))  # ray's stubs widen a class's handle

    @classmethod
    def connect(cls, name: str = "relax-weights", namespace: str | None = None) -> RayWeightStore:
        """Handle on a running store actor.

        Raises:
            ValueError: If no actor of that name exists.
        """
        import ray

        return cls(ray.get_actor(name, namespace=namespace))

    @property
    def actor(self) -> ActorHandle[WeightStoreActor]:
        """The store actor's handle."""
        return self._actor

    def publish(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> PublishStats:
        """Puts ``state_dict`` in the object store once, as numpy buffers readers map without copying
        (:mod:`~relax_services.weights.packed`; owned by this process), and registers it as ``version``. The put
        is the snapshot: the tensors may change as soon as this returns."""
        import ray

        from relax_services.weights.packed import pack_state

        start = time.perf_counter()
        packed = pack_state(state_dict)
        num_bytes = packed.num_bytes
        ref = ray.put(packed)
        del packed  # views of the caller's tensors
        put_seconds = time.perf_counter() - start
        ray.get(self._actor.register.remote(version, [ref], num_bytes, put_seconds))
        return PublishStats(version, num_bytes, time.perf_counter() - start)

    def latest_version(self) -> int | None:
        """Newest published version."""
        import ray

        return cast("int | None", ray.get(self._actor.latest_version.remote()))

    def fetch(self, have_version: int | None = None) -> WeightUpdate | None:
        """Newest weights from the object store if newer than ``have_version``."""
        import ray

        start = time.perf_counter()
        newest = cast(
            "tuple[int, list[ObjectRef[PackedWeights]]] | None", ray.get(self._actor.newest.remote(have_version))
        )
        if newest is None:
            return None
        version, (ref,) = newest
        from relax_services.weights.packed import unpack_state

        try:
            state_dict = unpack_state(ray.get(ref))  # views of the node's one copy; they keep it alive
        except ray.exceptions.ObjectLostError:
            return None  # the publisher died; its successor publishes again
        return WeightUpdate(version, state_dict, time.perf_counter() - start)

    def versions(self) -> list[int]:
        """Retained versions, oldest first."""
        import ray

        versions: list[int] = ray.get(self._actor.versions.remote())
        return versions

    def rollback(self, version: int) -> list[int]:
        """Drops versions newer than ``version`` (a trainer resumed from an older checkpoint); returns them."""
        import ray

        dropped: list[int] = ray.get(self._actor.rollback.remote(version))
        return dropped

    def history(self) -> list[dict[str, float]]:
        """Publication records kept by the actor."""
        import ray

        history: list[dict[str, float]] = ray.get(self._actor.history.remote())
        return history


class WeightPoller:
    """A :data:`~relax_services.engines.WeightPoll` over a store: fetches only versions newer than the engine's.

    Args:
        store: Where weights come from.
        current_version: Returns the version the reader holds (e.g. ``lambda: engine.version``).
        min_interval_s: Ask the store at most this often; calls in between return ``None`` without a
            round trip. A rollout engine polls between decode steps, and against a Ray store every ask is an
            actor call, so a few tens of milliseconds keep polling off the decode path.

    Attributes:
        sync_seconds: ``{version: fetch seconds}`` of every version handed out.
    """

    def __init__(
        self, store: WeightStore, current_version: Callable[[], int | None], min_interval_s: float = 0.0
    ) -> None:
        if min_interval_s < 0:
            raise ValueError(f"min_interval_s must be >= 0, got {min_interval_s}")
        self.store = store
        self.current_version = current_version
        self.min_interval_s = min_interval_s
        self.sync_seconds: dict[int, float] = {}
        self._last_ask = -math.inf

    def __call__(self) -> tuple[int, StateDict] | None:
        now = time.monotonic()
        if now - self._last_ask < self.min_interval_s:
            return None
        self._last_ask = now
        update = self.store.fetch(self.current_version())
        if update is None:
            return None
        self.sync_seconds[update.version] = update.seconds
        return update.version, update.state_dict
