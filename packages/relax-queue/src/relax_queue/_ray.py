"""Ray transport: one named queue actor, picklable clients with the sync queue API.

The actor (``num_cpus=0``) holds a :class:`TransferQueue` and serves blocking calls with the
asyncio face, so a waiting ``get`` never stalls other callers. Field values at or above
``object_store_threshold`` bytes (tensors, arrays, media) are ``ray.put`` by the producer and only
their references go through the actor; consumers fetch all references of a batch in one ``ray.get``.
Every client call is one actor call (counted in ``RayQueueClient.round_trips``) and moves many rows;
what it carries is described in ``_wire`` (mid-size numpy columns as pieces Ray inlines in the call), the
actor is in ``_ray_actor``, get requests and reply decoding in ``_ray_calls``. With ``pipeline_puts`` a put
returns once submitted and the actor serves the client's next get after it (see :class:`RayQueueClient`).

Field values whose classes live outside the modules every queue process has (a model's prompt object, a
tensor) travel as opaque :class:`~relax_queue._payload.Payload` bytes, pickled by the producer's client and
unpickled by the consumer's (``opaque_values``): the actor never imports the values' modules (see
``_payload.py``), and its byte count of such a value is its pickle's exact length.

Ray objects die with the process that owns them, and Ray >= 2.56 no longer lets a producer hand
ownership to another actor. With ``durable_payloads=True`` (default) the queue actor therefore
adopts each large value (``ray.put`` of it on the actor: one extra copy inside the object store),
so rows survive the death of their producer; ``False`` skips that copy and a dead producer's
large values become unreadable.

``ray`` is imported only inside functions.
"""

from __future__ import annotations

import contextlib
import functools
import uuid
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from relax_queue._batchers import Batcher, FixedSizeBatcher
from relax_queue._columnar import ColumnInput, is_array
from relax_queue._config import QueueConfig
from relax_queue._payload import PayloadPacker
from relax_queue._progress import batch_lease_id, check_get_arguments, normalise_fields
from relax_queue._ray_actor import actor_class, ray_module
from relax_queue._ray_calls import decode_batch, decode_columns, get_request, unwrap
from relax_queue._ray_reader import RayReader
from relax_queue._replica import ReplicaSet
from relax_queue._settle import check_version
from relax_queue._sizing import estimate_nbytes
from relax_queue._types import Batch, ColumnBatch, Key, RequeuedRow, RowInput
from relax_queue._wire import (
    StoreRef,
    chunk_arrays,
    may_hold_refs,
    pack,
    split_columns,
    unpack,
)

__all__ = ["RayQueueClient", "RayReader", "actor_options", "connect", "create_ray_queue"]

DEFAULT_OBJECT_STORE_THRESHOLD = 64 * 1024
DEFAULT_OBJECT_STORE_CHUNK_BYTES = 64 * 2**20


def actor_options(name: str, namespace: str | None, detached: bool) -> dict[str, Any]:
    """Ray options of a queue actor: named, up to 1000 calls at once (blocked gets wait on its event loop)."""
    options: dict[str, Any] = {"name": name, "max_concurrency": 1000}
    if namespace is not None:
        options["namespace"] = namespace
    if detached:
        options["lifetime"] = "detached"
    return options


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
    pipeline_puts: bool = False,
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
        pipeline_puts: this client's puts return once submitted; their errors surface on its next call
            (see :class:`RayQueueClient`).

    Raises:
        ValueError: an actor of that name already exists.
    """
    ray = ray_module()
    actor = actor_class().options(**actor_options(name, namespace, detached)).remote(config, durable_payloads)
    ray.get(actor.call.remote("metrics"))  # surface constructor errors here
    return RayQueueClient(
        actor, name, namespace, object_store_threshold, object_store_chunk_bytes, opaque_values, pipeline_puts
    )


def connect(
    name: str,
    *,
    queue: str | None = None,
    namespace: str | None = None,
    object_store_threshold: int = DEFAULT_OBJECT_STORE_THRESHOLD,
    object_store_chunk_bytes: int = DEFAULT_OBJECT_STORE_CHUNK_BYTES,
    opaque_values: bool = True,
    pipeline_puts: bool = False,
) -> RayQueueClient:
    """A client of the queue actor ``name`` (raises ``ValueError`` when there is none); ``queue``: the queue's name
    in an actor :func:`create_ray_queues` made (None for one :func:`create_ray_queue` made); other arguments as
    :func:`create_ray_queue`'s."""
    actor = ray_module().get_actor(name, namespace=namespace)
    return RayQueueClient(
        actor, name, namespace, object_store_threshold, object_store_chunk_bytes, opaque_values, pipeline_puts, queue
    )


@dataclass
class RayQueueClient:
    """Client of a Ray queue actor with the sync :class:`TransferQueue` API; picklable.

    Pass it to other Ray actors and tasks as an argument, or :func:`connect` by name.

    With ``pipeline_puts`` a put (``put``, ``put_many``, ``put_columns``) returns once it is submitted, and
    the client's next call overlaps with it: a get is sent at once and the actor serves it only after that
    put is applied (so the client reads its own writes, in one round trip less); any other call, a put
    included, first waits for the put. At most one put is in flight, so backpressure holds one call late.
    A put's error (a full queue, a closed one) is raised by the client's next call instead, and that call
    is not made; :meth:`flush` waits for the put in flight. Other clients see the rows only once the put is
    applied, so a producer that signals a consumer another way calls :meth:`flush` first. A copy of the
    client (pickled to another process) starts with nothing in flight.
    """

    actor: Any
    name: str
    namespace: str | None = None
    object_store_threshold: int = DEFAULT_OBJECT_STORE_THRESHOLD
    object_store_chunk_bytes: int = DEFAULT_OBJECT_STORE_CHUNK_BYTES
    opaque_values: bool = True
    pipeline_puts: bool = False
    queue: str | None = None
    """The queue's name inside an actor that holds several (:func:`create_ray_queues`); None: the actor is this
    queue's own (:func:`create_ray_queue`)."""
    round_trips: int = field(default=0, compare=False)
    """Calls this client made to the queue actor (each one round trip); every method makes one."""
    _pending: Any = field(default=None, compare=False, repr=False)  # the reference of the put in flight
    _session: str | None = field(default=None, compare=False, repr=False)  # names this copy's puts to the actor
    _seq: int = field(default=0, compare=False, repr=False)  # this copy's pipelined puts so far
    # Per task, the return values its next get_columns asks for: 1 + the pieces of chunked columns last time.
    _reply_slots: dict[str, int] = field(default_factory=dict, compare=False, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        # A copy is another submitter: the put in flight and the sequence of its puts stay with this one.
        return {**self.__dict__, "_pending": None, "_session": None, "_seq": 0}

    def _submit(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Submit one call to the queue actor (counted in :attr:`round_trips`); returns its reference."""
        self.round_trips += 1
        return getattr(self.actor, method).remote(*self._route, *args, **kwargs)

    def _submit_returning(self, slots: int, method: str, *args: Any) -> Any:
        """:meth:`_submit` of a call with ``slots`` return values (a list of references)."""
        self.round_trips += 1
        return getattr(self.actor, method).options(num_returns=slots).remote(*self._route, *args)

    @property
    def _route(self) -> tuple[str, ...]:
        """What each call carries before its own arguments: the queue's name in a group actor, else nothing."""
        return () if self.queue is None else (self.queue,)

    def _remote(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """:meth:`_submit` after the put in flight is applied (its error raised here, this call not made)."""
        if self._pending is not None:
            self.flush()
        return self._submit(method, *args, **kwargs)

    def flush(self) -> None:
        """Wait until the put in flight (``pipeline_puts``) is applied; raise its error. No call when none is."""
        pending, self._pending = self._pending, None
        if pending is not None:
            unwrap(pending)

    def _put_call(self, method: str, args: tuple[Any, ...], pieces: Sequence[Any] = ()) -> None:
        """Make a put call (``args``, then its ticket, then the ``pieces`` of chunked columns): wait for it, or
        (``pipeline_puts``) leave it in flight, numbered for the next get."""
        if not self.pipeline_puts:
            unwrap(self._remote(method, *args, None, *pieces))
            return
        self.flush()
        if self._session is None:
            self._session = uuid.uuid4().hex
        self._seq += 1
        self._pending = self._submit(method, *args, (self._session, self._seq), *pieces)

    def _get_call(self, method: str, request: Callable[[tuple[str, int] | None], bytes], slots: int = 1) -> Any:
        """Make a get call built by ``request(after)`` with ``slots`` return values; with a put in flight, the
        actor serves it after that put."""
        submit = self._submit if slots == 1 else functools.partial(self._submit_returning, slots)
        pending, self._pending = self._pending, None
        if pending is None:
            return unwrap(submit(method, request(None)))
        ref = submit(method, request((cast(str, self._session), self._seq)))
        try:
            unwrap(pending)  # the put's own error, if any (the actor refused the get then, leasing nothing)
        except BaseException:
            with contextlib.suppress(Exception):
                ray_module().get(ref)  # retrieved, so Ray does not report the refused get as unhandled
            raise
        return unwrap(ref)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return unwrap(self._remote("call", method, *args, **kwargs))

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
                        hit = stored[id(value)] = (value, StoreRef(ray_module().put(value), size))
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
        self._put_call("put_many", (pack(sent), admitted, timeout))

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
        inline, passed = split_columns(wire)
        pieces: list[Any] = []
        if passed:  # mid-size numpy columns as pieces small enough to ride in the call itself (see _wire)
            passed, pieces = chunk_arrays(passed)
        self._put_call("put_columns", (pack((cols.keys, inline, options)), passed), pieces)

    def _offload_column(self, column: list[Any], packer: PayloadPacker | None) -> list[Any]:
        """``column`` with its non-plain values packed (``packer``), its large values in the object store and a
        :class:`StoreRef` in each one's place.

        Consecutive large values share one object (a list) of at most ``object_store_chunk_bytes``:
        one ``ray.put`` and one reference for many rows (each costs Ray bookkeeping in the producer,
        the actor and the consumer). The cap bounds what a consumer of one row of a chunk fetches
        and how long memory of consumed rows stays held by a chunk's unconsumed rows.
        """
        if not may_hold_refs(column):
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
        put = ray_module().put
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
        return int(unwrap(self._remote("add_fields_many", {k: wire(f) for k, f in updates.items()})))

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
        return RayReader(self, task, normalise_fields(task, fields), batcher or FixedSizeBatcher(), replica)

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
        lease_s: float | None = None,
    ) -> Batch:
        """See :meth:`TransferQueue.get`; object-store values of the batch are fetched in one ``ray.get``.

        ``ack``: a batch of this task (of ``replica``'s rank) acked first, in the same round trip.
        """
        check_get_arguments(task, n, lease_s)  # a malformed get costs no round trip and acks nothing
        acked = None if ack is None else batch_lease_id(ack)
        task_name, lease_id, wire, lease_timeout_s, version = unpack(
            self._get_call(
                "get",
                lambda after: get_request(task, fields, n, batcher, timeout, replica, acked, after, 1, lease_s),
            )
        )
        return decode_batch(task_name, lease_id, wire, lease_timeout_s, version)

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
        lease_s: float | None = None,
    ) -> ColumnBatch:
        """See :meth:`TransferQueue.get_columns`; object-store values of the batch are fetched in one ``ray.get``.

        ``ack``: a batch of this task (of ``replica``'s rank) acked first, in the same round trip.
        """
        check_get_arguments(task, n, lease_s)
        acked = None if ack is None else batch_lease_id(ack)
        returns = self._reply_slots.get(task, 1)
        reply = self._get_call(
            "get_columns",
            lambda after: get_request(task, fields, n, batcher, timeout, replica, acked, after, returns, lease_s),
            returns,
        )
        if returns > 1:
            reply, pieces = reply[0], reply[1:]
            return decode_columns(reply, pieces, self._reply_slots, task)
        return decode_columns(reply, (), self._reply_slots, task)

    def ack(self, batch: Batch | ColumnBatch | int, *, rank: int | None = None) -> None:
        """See :meth:`TransferQueue.ack`."""
        self._call("ack", batch_lease_id(batch), rank=rank)

    def nack(self, batch: Batch | ColumnBatch | int) -> None:
        """See :meth:`TransferQueue.nack`."""
        self._call("nack", batch_lease_id(batch))

    def renew(self, batch: Batch | ColumnBatch | int, timeout_s: float | None = None) -> None:
        """See :meth:`TransferQueue.renew`."""
        self._call("renew", batch_lease_id(batch), timeout_s)

    # ------------------------------------------------------------------ staleness
    @property
    def version(self) -> int:
        """See :attr:`TransferQueue.version` (one small round trip, no metrics)."""
        return int(unwrap(self._remote("version")))

    def publish_version(self, version: int) -> None:
        """See :meth:`TransferQueue.publish_version`."""
        self._call("publish_version", version)

    def ack_and_publish(self, batch: Batch | ColumnBatch | int, version: int, *, rank: int | None = None) -> None:
        """See :meth:`TransferQueue.ack_and_publish`: one round trip for both (a version that is not an int is
        refused here, with no round trip)."""
        lease_id = batch_lease_id(batch)
        check_version(version)
        self._call("ack_and_publish", lease_id, version, rank=rank)

    def admit(self, n: int, timeout: float = 0.0) -> int:
        """See :meth:`TransferQueue.admit`."""
        return int(unwrap(self._remote("admit", n, timeout)))

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
        unwrap(self._remote("save", path))

    def load(self, path: str, *, reset_running: bool = True) -> None:
        """Restore from ``path`` (on the actor's node); leased rows are redelivered."""
        unwrap(self._remote("load", path, reset_running))

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
        """Kill the queue actor (its rows are lost unless saved; a put in flight is dropped unraised); an actor
        that holds several queues (:func:`create_ray_queues`) ends with all of them."""
        self._pending = None
        ray_module().kill(self.actor)
