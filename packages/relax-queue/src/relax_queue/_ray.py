"""Ray transport: one named queue actor, picklable clients with the sync queue API.

The actor (``num_cpus=0``) holds a :class:`TransferQueue` and serves blocking calls with the
asyncio face, so a waiting ``get`` never stalls other callers. Field values at or above
``object_store_threshold`` bytes (tensors, arrays, media) are ``ray.put`` by the producer and only
their references go through the actor; consumers fetch all references of a batch in one ``ray.get``.
Every call moves many rows.

Field values whose classes live outside the modules every queue process has (a model's prompt object, a
tensor) travel as opaque :class:`~relax_queue._payload.Payload` bytes, pickled by the producer's client and
unpickled by the consumer's (``opaque_values``): the actor never imports the values' modules (see
``_payload.py``), and its byte count of such a value is its pickle's exact length.

Ray objects die with the process that owns them, and Ray >= 2.56 no longer lets a producer hand
ownership to another actor. With ``durable_payloads=True`` (default) the queue actor therefore
adopts each large value (``ray.put`` of it on the actor: one extra copy inside the object store),
so rows survive the death of their producer; ``False`` skips that copy and a dead producer's
large values become unreadable.

``ray`` is imported only inside this module's functions.
"""

from __future__ import annotations

import functools
import gc
import pickle
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from relax_queue._batchers import Batcher, FixedSizeBatcher
from relax_queue._columnar import ColumnInput, is_array
from relax_queue._config import QueueConfig
from relax_queue._core import NO_TAGS
from relax_queue._payload import PayloadPacker, open_payloads
from relax_queue._queue import _lease_id, _normalise_fields
from relax_queue._replica import ReplicaSet
from relax_queue._sizing import estimate_nbytes
from relax_queue._types import Batch, ColumnBatch, Key, RequeuedRow, Row, RowInput

__all__ = ["RayQueueClient", "RayReader", "connect", "create_ray_queue"]

DEFAULT_OBJECT_STORE_THRESHOLD = 64 * 1024
DEFAULT_OBJECT_STORE_CHUNK_BYTES = 64 * 2**20
_SMALL_TYPES = frozenset((int, float, bool, str, type(None)))  # never large enough for the object store


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - exercised only where ray is absent
        raise ImportError("relax_queue's Ray transport needs ray: pip install 'relax-queue[ray]'") from exc
    return ray


class StoreRef:
    """A field value living in the Ray object store (the queue holds only this reference).

    ``index`` is ``None`` when the object is the value itself, else the value's position in the
    object, a list of the large values of one ``put_columns`` column (one object, one reference
    for them all: each reference passed through the actor costs Ray bookkeeping on both sides).
    Such an object lives until the last row holding it is freed.
    """

    __slots__ = ("index", "nbytes", "ref")

    def __init__(self, ref: Any, nbytes: int, index: int | None = None) -> None:
        self.ref = ref
        self.nbytes = nbytes  # read by estimate_nbytes, so capacity counts the real payload
        self.index = index

    def pick(self, stored: Any) -> Any:
        """This value, out of ``stored``: the object its reference names, fetched."""
        return stored if self.index is None else stored[self.index]


def _resolve(values: list[StoreRef]) -> list[Any]:
    """The values ``values`` stand for, each object fetched once in one ``ray.get``."""
    objects = list(dict.fromkeys(v.ref for v in values))
    fetched = dict(zip(objects, _ray().get(objects), strict=True))
    return [v.pick(fetched[v.ref]) for v in values]


@functools.cache
def _actor_class() -> Any:
    import asyncio

    ray = _ray()
    from relax_queue._async import AsyncTransferQueue
    from relax_queue._queue import TransferQueue

    @ray.remote(num_cpus=0)
    class QueueActor:
        """Holds the queue; every method is one round trip for many rows."""

        def __init__(self, config: QueueConfig, durable_payloads: bool) -> None:
            self.queue = TransferQueue(config)
            self.aqueue = AsyncTransferQueue(self.queue)
            self.durable = durable_payloads
            # The worker's own objects (Ray, its imports: ~67k) live as long as the process; frozen,
            # the collections that the queue's many short-lived rows trigger no longer traverse them
            # (a 10,000-row put_columns: 18.6 -> 11 ms here).
            gc.freeze()

        async def adopt(self, fields_list: list[Mapping[str, Any]]) -> None:
            """Re-own object-store values (one ``ray.put`` here) so they outlive their producer."""
            if self.durable:
                await self.adopt_refs([v for fields in fields_list for v in fields.values() if isinstance(v, StoreRef)])

        async def adopt_refs(self, refs: list[StoreRef]) -> None:
            """Re-own these object-store values (see :meth:`adopt`); an object several share, once."""
            if refs:
                objects = list(dict.fromkeys(r.ref for r in refs))
                values = await asyncio.gather(*objects)
                adopted = {old: ray.put(value) for old, value in zip(objects, values, strict=True)}
                for r in {id(r): r for r in refs}.values():  # rows sharing a value share its StoreRef: once
                    r.ref = adopted[r.ref]

        async def put_many(self, wire: list[tuple[Any, ...]], admitted: bool, timeout: float | None) -> None:
            rows = [RowInput(*item) for item in wire]
            await self.adopt([r.fields for r in rows])
            await self.aqueue.put_many(rows, admitted=admitted, timeout=timeout)

        async def put_columns(self, keys: list[Key], columns: dict[str, list[Any]], options: dict[str, Any]) -> None:
            """One round trip for all rows: the keys, one list per field, and put_columns' keyword arguments."""
            if self.durable:
                await self.adopt_refs(
                    [
                        v
                        for column in columns.values()
                        if type(column) is list and _may_hold_refs(column)
                        for v in column
                        if isinstance(v, StoreRef)
                    ]
                )
                for name, column in columns.items():
                    if is_array(column) and not _writeable(column):
                        # Deserialised from the producer's object (a large argument travels through the
                        # object store, owned by the caller): a copy of our own outlives the producer.
                        columns[name] = column.copy()
            await self.aqueue.put_columns(keys, columns, **options)

        async def get_columns(self, request: bytes) -> tuple[Any, ...]:
            task, fields, n, batcher, timeout, replica, ack = _load_request(request)
            self._ack_first(ack, replica)
            b = await self.aqueue.get_columns(
                task, fields=fields, n=n, batcher=batcher, timeout=timeout, replica=replica
            )
            # A tuple of lists pickles faster than the slotted dataclass; per-row metadata that is
            # the same for every row (the usual case) travels once.
            return (
                b.task,
                b.lease_id,
                b.keys,
                b.columns,
                _pack_ints(b.v_min),
                _pack_ints(b.v_max),
                _pack(b.group_ids),
                _pack_ints(b.group_sizes),
                _pack_tags(b.tags),
                _pack_ints(b.staleness),
                _pack(b.stale),
                _pack_ints(b.deliveries),
                b.lease_timeout_s,
                b.version,
            )

        async def add_fields_many(self, updates: dict[Key, Mapping[str, Any]]) -> int:
            await self.adopt(list(updates.values()))
            return self.queue.add_fields_many(updates)

        def _ack_first(self, lease_id: int | None, replica: ReplicaSet | None) -> None:
            """Ack the batch a get carries (the reader's previous one) before leasing the next."""
            if lease_id is not None:
                self.queue.ack(lease_id, rank=None if replica is None else replica.rank)

        async def get(self, request: bytes) -> tuple[Any, ...]:
            task, fields, n, batcher, timeout, replica, ack = _load_request(request)
            self._ack_first(ack, replica)
            batch = await self.aqueue.get(task, fields=fields, n=n, batcher=batcher, timeout=timeout, replica=replica)
            # Plain tuples pickle several times faster than slotted dataclasses.
            rows = [
                (
                    r.key,
                    r.fields,
                    r.v_min,
                    r.v_max,
                    r.group_id,
                    r.group_size,
                    r.tags,
                    r.staleness,
                    r.stale,
                    r.deliveries,
                )
                for r in batch.rows
            ]
            return batch.task, batch.lease_id, rows, batch.lease_timeout_s, batch.version

        def version(self) -> int:
            return self.queue.version

        async def admit(self, n: int, timeout: float) -> int:
            return await self.aqueue.admit(n, timeout)

        def load(self, path: str, reset_running: bool) -> None:
            # Payloads stay packed here: only consumers' clients open them.
            self.queue.load(path, reset_running=reset_running, open_payloads=False)

        async def save(self, path: str) -> None:
            state = self.queue.state_dict()
            for row in state["rows"]:  # snapshots hold values, not object-store references
                for name, value in row["fields"].items():
                    if isinstance(value, StoreRef):
                        row["fields"][name] = value.pick(await value.ref)
            from relax_queue._snapshot import atomic_write

            atomic_write(path, state)

        def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
            return getattr(self.queue, method)(*args, **kwargs)

    return QueueActor


def _request(
    task: str,
    fields: tuple[str, ...] | None,
    n: int | None,
    batcher: Batcher | None,
    timeout: float | None,
    replica: ReplicaSet | None,
    ack: int | None,
) -> bytes:
    """A get's arguments as one bytes object: Ray serialises each argument of a call on its own
    (≈ 0.2 ms for a get's seven here), one pickled blob costs one. Batchers and replica sets go
    through cloudpickle, so classes Ray would ship by value still travel."""
    return cast(
        bytes, _ray().cloudpickle.dumps((task, fields, n, batcher or FixedSizeBatcher(), timeout, replica, ack))
    )


def _load_request(request: bytes) -> tuple[Any, ...]:
    return cast("tuple[Any, ...]", pickle.loads(request))


class _Same:
    """Wire form of a per-row metadata column in which every row holds ``value`` (an immutable scalar)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce__(self) -> tuple[type[_Same], tuple[Any]]:
        return _Same, (self.value,)


class _EmptyTags:
    """Wire form of a tags column in which every row's tags are empty."""

    __slots__ = ()

    def __reduce__(self) -> tuple[type[_EmptyTags], tuple[()]]:
        return _EmptyTags, ()


def _pack(column: list[Any]) -> list[Any] | _Same:
    """``column`` for the wire: its one value when every row holds the same scalar (of one type)."""
    if column and column.count(column[0]) == len(column):
        kinds = set(map(type, column))
        if len(kinds) == 1 and kinds <= _SMALL_TYPES:
            return _Same(column[0])
    return column


def _pack_ints(column: list[Any]) -> list[Any] | _Same:
    """:func:`_pack` for a column the queue fills with ints (or ``None``) only: versions, staleness,
    deliveries, group sizes. Their type needs no per-row check (a C-level count is all)."""
    if column and column.count(column[0]) == len(column) and type(column[0]) in _SMALL_TYPES:
        return _Same(column[0])
    return column


def _pack_tags(tags: list[Any]) -> list[Any] | _EmptyTags:
    return _EmptyTags() if tags and tags.count(NO_TAGS) == len(tags) else tags


def _unpack(column: list[Any] | _Same | _EmptyTags, n: int) -> list[Any]:
    """A column as :func:`_pack` or :func:`_pack_tags` sent it, one entry per row again."""
    kind = type(column)
    if kind is _Same:
        return [cast(_Same, column).value] * n
    if kind is _EmptyTags:
        return [NO_TAGS] * n  # the read-only empty tags every row put without tags shares in-process
    return cast("list[Any]", column)


def _writeable(array: Any) -> bool:
    """Whether an array owns writeable memory (numpy ``flags.writeable``; other array types: assumed)."""
    flags = getattr(array, "flags", None)
    return bool(getattr(flags, "writeable", True))


def _may_hold_refs(column: list[Any]) -> bool:
    """Whether a column may hold values large enough for the object store (a cheap test by type, in C)."""
    return not set(map(type, column)) <= _SMALL_TYPES


def _unwrap(refs: Any) -> Any:
    """``ray.get`` that re-raises the queue's own exception instead of Ray's wrapper."""
    ray = _ray()
    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as err:
        cause = getattr(err, "cause", None)
        if isinstance(cause, BaseException):
            raise cause from None
        raise


def create_ray_queue(
    name: str,
    config: QueueConfig,
    *,
    namespace: str | None = None,
    detached: bool = False,
    object_store_threshold: int = DEFAULT_OBJECT_STORE_THRESHOLD,
    object_store_chunk_bytes: int = DEFAULT_OBJECT_STORE_CHUNK_BYTES,
    durable_payloads: bool = True,
    opaque_values: bool = True,
) -> RayQueueClient:
    """Start the named queue actor (once per cluster) and return a client.

    Args:
        name: actor name; other processes :func:`connect` to it.
        config: the queue configuration.
        namespace: Ray namespace of the actor (default: the job's).
        detached: keep the actor alive after the creating job exits.
        object_store_threshold: field values of at least this many bytes go through the object store.
        object_store_chunk_bytes: ``put_columns`` stores consecutive large values of a column as one
            object of at most this many bytes (one ``ray.put`` and one reference for many rows).
        durable_payloads: the actor adopts object-store values so they outlive their producer
            (one extra copy in the object store); ``False`` trades that safety for speed.
        opaque_values: this client sends field values of classes outside ``PLAIN_MODULES`` as pickled
            payloads, so the actor never imports their modules (``False``: as they are).

    Raises:
        ValueError: an actor of that name already exists.
    """
    ray = _ray()
    options: dict[str, Any] = {"name": name, "max_concurrency": 1000}
    if namespace is not None:
        options["namespace"] = namespace
    if detached:
        options["lifetime"] = "detached"
    actor = _actor_class().options(**options).remote(config, durable_payloads)
    ray.get(actor.call.remote("metrics"))  # surface constructor errors here
    return RayQueueClient(actor, name, namespace, object_store_threshold, object_store_chunk_bytes, opaque_values)


def connect(
    name: str,
    *,
    namespace: str | None = None,
    object_store_threshold: int = DEFAULT_OBJECT_STORE_THRESHOLD,
    object_store_chunk_bytes: int = DEFAULT_OBJECT_STORE_CHUNK_BYTES,
    opaque_values: bool = True,
) -> RayQueueClient:
    """A client of the queue actor ``name`` (raises ``ValueError`` when there is none)."""
    actor = _ray().get_actor(name, namespace=namespace)
    return RayQueueClient(actor, name, namespace, object_store_threshold, object_store_chunk_bytes, opaque_values)


@dataclass
class RayQueueClient:
    """Client of a Ray queue actor with the sync :class:`TransferQueue` API; picklable.

    Pass it to other Ray actors and tasks as an argument, or :func:`connect` by name.
    """

    actor: Any
    name: str
    namespace: str | None = None
    object_store_threshold: int = DEFAULT_OBJECT_STORE_THRESHOLD
    object_store_chunk_bytes: int = DEFAULT_OBJECT_STORE_CHUNK_BYTES
    opaque_values: bool = True

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _unwrap(self.actor.call.remote(method, *args, **kwargs))

    def _wire_rows(self) -> Any:
        """A function giving one message's rows' fields as they travel: non-plain values packed (when
        ``opaque_values``), large values in the object store; a value several rows share, once."""
        packer = PayloadPacker() if self.opaque_values else None
        stored: dict[int, tuple[Any, StoreRef]] = {}  # id(value) -> (value kept alive, its reference)

        def wire(fields: Mapping[str, Any]) -> Mapping[str, Any]:
            if packer is not None:
                fields = packer.pack_fields(fields)
            out: dict[str, Any] | None = None
            for name, value in fields.items():
                size = estimate_nbytes(value)
                if size >= self.object_store_threshold:
                    if out is None:
                        out = dict(fields)
                    hit = stored.get(id(value))
                    if hit is None:
                        hit = stored[id(value)] = (value, StoreRef(_ray().put(value), size))
                    out[name] = hit[1]
            return fields if out is None else out

        return wire

    # ------------------------------------------------------------------ producers
    def put(
        self,
        key: Key,
        fields: Mapping[str, Any],
        *,
        versions: tuple[int, int] | int | None = None,
        group_id: Hashable | None = None,
        group_size: int | None = None,
        tags: Mapping[str, int | float | str] | None = None,
        admitted: bool = False,
        timeout: float | None = None,
    ) -> None:
        """See :meth:`TransferQueue.put`."""
        self.put_many(
            [RowInput(key, fields, versions, group_id, group_size, tags or {})], admitted=admitted, timeout=timeout
        )

    def put_many(self, rows: Sequence[RowInput], *, admitted: bool = False, timeout: float | None = None) -> None:
        """See :meth:`TransferQueue.put_many`; one round trip, large values via the object store."""
        wire = self._wire_rows()
        sent = [(r.key, wire(r.fields), r.versions, r.group_id, r.group_size, r.tags) for r in rows]
        _unwrap(self.actor.put_many.remote(sent, admitted, timeout))

    def put_columns(
        self,
        keys: Sequence[Key],
        columns: Mapping[str, Sequence[Any]],
        *,
        v_min: int | Sequence[int] | None = None,
        v_max: int | Sequence[int] | None = None,
        group_ids: Sequence[Hashable | None] | None = None,
        group_sizes: int | Sequence[int | None] | None = None,
        tags: Mapping[str, Sequence[int | float | str]] | None = None,
        admitted: bool = False,
        timeout: float | None = None,
    ) -> None:
        """See :meth:`TransferQueue.put_columns`; one round trip carrying the columns, large values via the
        object store. Arguments are validated here first, so a malformed call costs no round trip."""
        cols = ColumnInput(keys, columns, v_min, v_max, group_ids, group_sizes, tags)
        # An array column travels whole: one buffer (Ray moves a large argument through the object
        # store by itself); a list column has its large values put in the object store.
        packer = PayloadPacker() if self.opaque_values else None
        wire = {
            name: column if is_array(column) else self._offload_column(column, packer)
            for name, column in zip(cols.names, cols.columns, strict=True)
        }
        options = {  # the validated, list-valued form of the arguments
            "v_min": cols.v_min if cols.versions_given else None,
            "v_max": cols.v_max if cols.versions_given else None,
            "group_ids": cols.group_ids,
            "group_sizes": cols.group_sizes,
            "tags": {name: list(values) for name, values in tags.items()} if tags else None,
            "admitted": admitted,
            "timeout": timeout,
        }
        _unwrap(self.actor.put_columns.remote(cols.keys, wire, options))

    def _offload_column(self, column: list[Any], packer: PayloadPacker | None) -> list[Any]:
        """``column`` with its non-plain values packed (``packer``), its large values in the object store and a
        :class:`StoreRef` in each one's place.

        Consecutive large values share one object (a list) of at most ``object_store_chunk_bytes``:
        one ``ray.put`` and one reference for many rows (each costs Ray bookkeeping in the producer,
        the actor and the consumer). The cap bounds what a consumer of one row of a chunk fetches
        and how long memory of consumed rows stays held by a chunk's unconsumed rows.
        """
        if not _may_hold_refs(column):
            return column
        if packer is not None:
            column = packer.pack_column(column)
        threshold, cap = self.object_store_threshold, self.object_store_chunk_bytes
        chunks: list[list[tuple[int, int]]] = []
        chunk_bytes = 0
        for i, size in enumerate(map(estimate_nbytes, column)):
            if size < threshold:
                continue
            if not chunks or chunk_bytes + size > cap:
                chunks.append([])
                chunk_bytes = 0
            chunks[-1].append((i, size))
            chunk_bytes += size
        if not chunks:
            return column
        out = list(column)
        put = _ray().put
        for chunk in chunks:
            if len(chunk) == 1:
                i, size = chunk[0]
                out[i] = StoreRef(put(column[i]), size)
                continue
            ref = put([column[i] for i, _ in chunk])
            for position, (i, size) in enumerate(chunk):
                out[i] = StoreRef(ref, size, position)
        return out

    def add_fields(self, key: Key, fields: Mapping[str, Any]) -> bool:
        """See :meth:`TransferQueue.add_fields`."""
        return self.add_fields_many({key: fields}) == 1

    def add_fields_many(self, updates: Mapping[Key, Mapping[str, Any]]) -> int:
        """See :meth:`TransferQueue.add_fields_many`."""
        wire = self._wire_rows()
        return int(_unwrap(self.actor.add_fields_many.remote({k: wire(f) for k, f in updates.items()})))

    # ------------------------------------------------------------------ consumers
    def reader(
        self,
        task: str,
        fields: Iterable[str] | None = None,
        batcher: Batcher | None = None,
        *,
        replica: ReplicaSet | None = None,
    ) -> RayReader:
        """See :meth:`TransferQueue.reader`."""
        return RayReader(self, task, _normalise_fields(task, fields), batcher or FixedSizeBatcher(), replica)

    def get(
        self,
        task: str,
        *,
        fields: tuple[str, ...] | None = None,
        n: int | None = None,
        batcher: Batcher | None = None,
        timeout: float | None = None,
        replica: ReplicaSet | None = None,
        ack: Batch | ColumnBatch | int | None = None,
    ) -> Batch:
        """See :meth:`TransferQueue.get`; object-store values of the batch are fetched in one ``ray.get``.

        ``ack``: a batch of this task (of ``replica``'s rank) acked first, in the same round trip.
        """
        acked = None if ack is None else _lease_id(ack)
        task_name, lease_id, wire, lease_timeout_s, version = _unwrap(
            self.actor.get.remote(_request(task, fields, n, batcher, timeout, replica, acked))
        )
        batch = Batch(task_name, lease_id, [Row(*item) for item in wire], lease_timeout_s, version)
        slots = [
            (row.fields, name, v) for row in batch.rows for name, v in row.fields.items() if isinstance(v, StoreRef)
        ]
        if slots:
            for (row_fields, name, _), value in zip(slots, _resolve([v for _, _, v in slots]), strict=True):
                row_fields[name] = value
        open_payloads((row.fields for row in batch.rows), dict.items)
        return batch

    def get_columns(
        self,
        task: str,
        *,
        fields: tuple[str, ...] | None = None,
        n: int | None = None,
        batcher: Batcher | None = None,
        timeout: float | None = None,
        replica: ReplicaSet | None = None,
        ack: Batch | ColumnBatch | int | None = None,
    ) -> ColumnBatch:
        """See :meth:`TransferQueue.get_columns`; object-store values of the batch are fetched in one ``ray.get``.

        ``ack``: a batch of this task (of ``replica``'s rank) acked first, in the same round trip.
        """
        acked = None if ack is None else _lease_id(ack)
        wire = _unwrap(self.actor.get_columns.remote(_request(task, fields, n, batcher, timeout, replica, acked)))
        n_rows = len(wire[2])
        batch = ColumnBatch(*wire[:4], *(_unpack(column, n_rows) for column in wire[4:12]), *wire[12:])
        slots = [
            (column, i, value)
            for column in batch.columns.values()
            if type(column) is list and _may_hold_refs(column)
            for i, value in enumerate(column)
            if isinstance(value, StoreRef)
        ]
        if slots:
            for (column, i, _), value in zip(slots, _resolve([v for _, _, v in slots]), strict=True):
                column[i] = value
        open_payloads((c for c in batch.columns.values() if type(c) is list and _may_hold_refs(c)), enumerate)
        return batch

    def ack(self, batch: Batch | ColumnBatch | int, *, rank: int | None = None) -> None:
        """See :meth:`TransferQueue.ack`."""
        self._call("ack", _lease_id(batch), rank=rank)

    def nack(self, batch: Batch | ColumnBatch | int) -> None:
        """See :meth:`TransferQueue.nack`."""
        self._call("nack", _lease_id(batch))

    def renew(self, batch: Batch | ColumnBatch | int, timeout_s: float | None = None) -> None:
        """See :meth:`TransferQueue.renew`."""
        self._call("renew", _lease_id(batch), timeout_s)

    # ------------------------------------------------------------------ staleness
    @property
    def version(self) -> int:
        """See :attr:`TransferQueue.version` (one small round trip, no metrics)."""
        return int(_unwrap(self.actor.version.remote()))

    def publish_version(self, version: int) -> None:
        """See :meth:`TransferQueue.publish_version`."""
        self._call("publish_version", version)

    def admit(self, n: int, timeout: float = 0.0) -> int:
        """See :meth:`TransferQueue.admit`."""
        return int(_unwrap(self.actor.admit.remote(n, timeout)))

    def release_admission(self, n: int = 1, *, failed: bool = False) -> None:
        """See :meth:`TransferQueue.release_admission`."""
        self._call("release_admission", n, failed=failed)

    def refund_admission(self, n: int) -> None:
        """See :meth:`TransferQueue.refund_admission`."""
        self._call("refund_admission", n)

    def admission_capacity(self) -> int | None:
        """See :meth:`TransferQueue.admission_capacity`."""
        result = self._call("admission_capacity")
        return None if result is None else int(result)

    def take_requeued(self, max_n: int | None = None) -> list[RequeuedRow]:
        """See :meth:`TransferQueue.take_requeued`."""
        return list(self._call("take_requeued", max_n))

    # ------------------------------------------------------------------ snapshots, metrics, lifetime
    def save(self, path: str) -> None:
        """Snapshot to ``path`` (on the actor's node) with object-store values inlined."""
        _unwrap(self.actor.save.remote(path))

    def load(self, path: str, *, reset_running: bool = True) -> None:
        """Restore from ``path`` (on the actor's node); leased rows are redelivered."""
        _unwrap(self.actor.load.remote(path, reset_running))

    def ready(self, task: str, fields: Sequence[str] | None = None) -> int:
        """See :meth:`TransferQueue.ready`."""
        return int(self._call("ready", task, None if fields is None else tuple(fields)))

    def metrics(self) -> dict[str, Any]:
        """See :meth:`TransferQueue.metrics`."""
        return dict(self._call("metrics"))

    def __len__(self) -> int:
        return int(self._call("__len__"))

    def close(self) -> None:
        """See :meth:`TransferQueue.close`: blocked and later calls that change the queue fail, for every client."""
        self._call("close")

    def shutdown(self) -> None:
        """Kill the queue actor (its rows are lost unless saved)."""
        _ray().kill(self.actor)


@dataclass
class RayReader:
    """A reader over the Ray transport (see :class:`Reader`)."""

    client: RayQueueClient
    task: str
    fields: tuple[str, ...] | None
    batcher: Batcher
    replica: ReplicaSet | None = None

    def get(
        self, n: int | None = None, timeout: float | None = None, *, ack: Batch | ColumnBatch | None = None
    ) -> Batch:
        """Lease the next batch, after acking ``ack`` in the same round trip (see :meth:`Reader.get`)."""
        return self.client.get(
            self.task, fields=self.fields, n=n, batcher=self.batcher, timeout=timeout, replica=self.replica, ack=ack
        )

    def get_columns(
        self, n: int | None = None, timeout: float | None = None, *, ack: Batch | ColumnBatch | None = None
    ) -> ColumnBatch:
        """Lease the next batch as columns, after acking ``ack`` in the same round trip (see :meth:`Reader.get`)."""
        return self.client.get_columns(
            self.task, fields=self.fields, n=n, batcher=self.batcher, timeout=timeout, replica=self.replica, ack=ack
        )

    def ack(self, batch: Batch | ColumnBatch) -> None:
        """Consume ``batch``."""
        self.client.ack(batch, rank=None if self.replica is None else self.replica.rank)

    def nack(self, batch: Batch | ColumnBatch) -> None:
        """Give ``batch`` back for redelivery."""
        self.client.nack(batch)

    def renew(self, batch: Batch | ColumnBatch, timeout_s: float | None = None) -> None:
        """Extend the lease of ``batch``."""
        self.client.renew(batch, timeout_s)
