"""The Ray queue actor: holds a :class:`TransferQueue` and serves every client call in one round trip.

Blocking calls are served with the asyncio face, so a waiting ``get`` never stalls other callers.
What each call carries is described in ``_wire``; the client is in ``_ray``. ``ray`` is imported
only inside this module's functions.
"""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Coroutine, Mapping
from typing import Any, cast

from relax_queue._columnar import is_array
from relax_queue._config import QueueConfig
from relax_queue._errors import RelaxQueueError
from relax_queue._progress import check_get_arguments
from relax_queue._replica import ReplicaSet
from relax_queue._types import Key, RowInput
from relax_queue._wire import (
    StoreRef,
    chunk_arrays,
    join_columns,
    load_request,
    may_hold_refs,
    pack,
    pack_column,
    pack_ints,
    pack_tags,
    split_columns,
    unchunk,
    unpack,
)

__all__ = ["ROUTED_METHODS", "actor_class", "group_actor_class", "ray_module"]


def ray_module() -> Any:
    """``ray``, imported now; a clear error names the extra to install when it is missing."""
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - exercised only where ray is absent
        raise ImportError("relax_queue's Ray transport needs ray: pip install 'relax-queue[ray]'") from exc
    return ray


@functools.cache
def actor_class() -> Any:
    """The queue actor's Ray class (made once: defining it needs ray)."""
    return ray_module().remote(num_cpus=0)(_queue_server())


@functools.cache
def group_actor_class(host: type | None = None) -> Any:
    """The Ray class of an actor that holds several named queues (made once per ``host``): each method of the queue
    actor, with the queue's name first (:func:`_routed`); every queue keeps its own state, one event loop serves them
    all.

    Args:
        host: A plain class whose methods the actor serves besides the queues' (its instance's state lives in the
            same process; ``__init__`` takes the queues' arguments first, then ``host``'s). Its methods run on the
            actor's event loop, so they must be short; none may share a name with :data:`ROUTED_METHODS` or use the
            attribute ``queues``.

    Raises:
        ValueError: ``host`` has an attribute of one of those names.
    """
    server = _queue_server()
    if host is not None:
        clash = sorted(name for name in (*ROUTED_METHODS, "queues") if hasattr(host, name))
        if clash:
            raise ValueError(f"{host.__name__} cannot share a queue group actor: it has {', '.join(clash)}")

    def __init__(self: Any, configs: Mapping[str, QueueConfig], durable_payloads: bool, *host_args: Any) -> None:
        if not configs:
            raise ValueError("a queue group actor needs at least one queue")
        if host is not None:
            cast(Any, host).__init__(self, *host_args)  # the mixin's own constructor, on this instance
        self.queues = {name: server(config, durable_payloads) for name, config in configs.items()}

    methods: dict[str, Any] = {"__init__": __init__, "__doc__": "Holds several named queues, one actor process."}
    for method in ROUTED_METHODS:
        methods[method] = _routed(method, getattr(server, method))
    bases = () if host is None else (host,)
    name = "QueueGroupActor" if host is None else f"QueueGroupActor_{host.__name__}"
    return ray_module().remote(num_cpus=0)(type(name, bases, methods))


ROUTED_METHODS = (
    "put_many",
    "put_columns",
    "get_columns",
    "add_fields_many",
    "get",
    "version",
    "admit",
    "load",
    "save",
    "call",
)
"""The queue actor's methods a client calls (a group actor takes each with the queue's name first)."""


def _routed(method: str, impl: Any) -> Any:
    """Method ``method`` of the group actor: the same method of the named queue's server (a coroutine when that one
    is: Ray then awaits it on the actor's event loop)."""

    def server_of(self: Any, queue: str) -> Any:
        try:
            return self.queues[queue]
        except KeyError:
            raise RelaxQueueError(f"no queue {queue!r} in this actor; it holds: {', '.join(self.queues)}") from None

    if inspect.iscoroutinefunction(impl):

        async def routed_async(self: Any, queue: str, *args: Any, **kwargs: Any) -> Any:
            return await getattr(server_of(self, queue), method)(*args, **kwargs)

        routed: Any = routed_async
    else:

        def routed_sync(self: Any, queue: str, *args: Any, **kwargs: Any) -> Any:
            return getattr(server_of(self, queue), method)(*args, **kwargs)

        routed = routed_sync
    routed.__name__ = routed.__qualname__ = method
    routed.__doc__ = f"The queue actor's ``{method}`` of queue ``queue``."
    return routed


@functools.cache
def _queue_server() -> Any:
    """The body of a queue actor as a plain class (made once: its methods use ray): a Ray actor of its own
    (:func:`actor_class`), or one of several in a group actor (:func:`group_actor_class`)."""
    import asyncio

    ray = ray_module()
    from relax_queue._async import AsyncTransferQueue
    from relax_queue._queue import TransferQueue

    class QueueActor:
        """Holds the queue; every method is one round trip for many rows."""

        def __init__(self, config: QueueConfig, durable_payloads: bool) -> None:
            self.queue = TransferQueue(config)
            self.aqueue = AsyncTransferQueue(self.queue)
            self.durable = durable_payloads
            # Pipelined puts (a client's ``pipeline_puts``): per client copy, the number of its last applied
            # put and that put's error; a get that names a put waits here until it is applied.
            self.applied: dict[str, tuple[int, BaseException | None]] = {}
            self.applied_changed = asyncio.Condition()
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
                # Awaiting makes the objects local without blocking the loop; the values are then
                # taken with ray.get (local now: no wait). Putting the value an await returns cost
                # 10-12 ms for 16 MiB here, the value ray.get returns 1.6-2.4 ms (Ray 2.60).
                await asyncio.gather(*objects)
                values = ray.get(objects)
                adopted = {old: ray.put(value) for old, value in zip(objects, values, strict=True)}
                for r in {id(r): r for r in refs}.values():  # rows sharing a value share its StoreRef: once
                    r.ref = adopted[r.ref]

        async def _sequenced(self, ticket: tuple[str, int] | None, work: Coroutine[Any, Any, None]) -> None:
            """Run a put; a pipelined one (``ticket``: its client copy and number) records that it is applied."""
            if ticket is None:
                await work
                return
            error: BaseException | None = None
            try:
                await work
            except BaseException as exc:
                error = exc
                raise
            finally:
                self.applied[ticket[0]] = (ticket[1], error)
                async with self.applied_changed:
                    self.applied_changed.notify_all()

        async def _after(self, ticket: tuple[str, int] | None) -> None:
            """Wait until the pipelined put ``ticket`` names is applied; refuse the get when it failed."""
            if ticket is None:
                return
            session, seq = ticket
            async with self.applied_changed:
                await self.applied_changed.wait_for(lambda: self.applied.get(session, (0, None))[0] >= seq)
            if self.applied[session][1] is not None:
                raise RelaxQueueError(f"get not served: the put before it failed ({self.applied[session][1]!r})")

        async def put_many(
            self, wire: Any, admitted: bool, timeout: float | None, ticket: tuple[str, int] | None = None
        ) -> None:
            """A put of rows; ``ticket`` numbers a pipelined put (see :meth:`_sequenced`)."""
            await self._sequenced(ticket, self._put_many(wire, admitted, timeout))

        async def _put_many(self, wire: Any, admitted: bool, timeout: float | None) -> None:
            rows = [RowInput(*item) for item in unpack(wire)]
            await self.adopt([r.fields for r in rows])
            await self.aqueue.put_many(rows, admitted=admitted, timeout=timeout)

        async def put_columns(
            self, head: Any, passed: dict[str, Any] | None, ticket: tuple[str, int] | None = None, *pieces: Any
        ) -> None:
            """One round trip for all rows: keys, small columns and put_columns' keyword arguments in
            ``head`` (see ``_wire``), large array columns and object-store references in ``passed``, the
            pieces of mid-size numpy columns in ``pieces``; ``ticket`` numbers a pipelined put."""
            await self._sequenced(ticket, self._put_columns(head, passed, pieces))

        async def _put_columns(self, head: Any, passed: dict[str, Any] | None, pieces: tuple[Any, ...]) -> None:
            keys, inline, options = unpack(head)
            columns = unchunk(join_columns(inline, passed), pieces)
            if self.durable and passed:  # only passed columns come from the producer's objects
                await self.adopt_refs(
                    [
                        v
                        for column in passed.values()
                        if type(column) is list and may_hold_refs(column)
                        for v in column
                        if isinstance(v, StoreRef)
                    ]
                )
                for name in passed:
                    column = columns[name]  # a column joined from pieces is an array of our own already
                    if is_array(column) and not _writeable(column):
                        # Deserialised from the producer's object (a large argument travels through the
                        # object store, owned by the caller): a copy of our own outlives the producer.
                        columns[name] = column.copy()
            await self.aqueue.put_columns(keys, columns, **options)

        async def get_columns(self, request: bytes) -> Any:
            """A get of columns; the client asked for ``slots`` return values: the reply, then pieces."""
            task, fields, n, batcher, timeout, replica, ack, after, slots, lease_s = load_request(request)
            await self._after(after)
            check_get_arguments(task, n, lease_s)  # before the ack: a malformed get changes nothing
            self._ack_first(ack, replica)
            b = await self.aqueue.get_columns(
                task, fields=fields, n=n, batcher=batcher, timeout=timeout, replica=replica, lease_s=lease_s
            )
            inline, passed = split_columns(b.columns)
            # A tuple of lists pickles faster than the slotted dataclass; per-row metadata that is
            # the same for every row (the usual case) travels once.
            head = (
                b.task,
                b.lease_id,
                b.keys,
                inline,
                pack_ints(b.v_min),
                pack_ints(b.v_max),
                pack_column(b.group_ids),
                pack_ints(b.group_sizes),
                pack_tags(b.tags),
                pack_ints(b.staleness),
                pack_column(b.stale),
                pack_ints(b.deliveries),
                b.lease_timeout_s,
                b.version,
            )
            # Bytes alone when all of it pickled; else a list, which Ray packs natively (a tuple it pickles).
            blob = pack(head)
            needed, sent = 0, []
            if passed:
                chunked, pieces = chunk_arrays(passed)
                needed = len(pieces)  # the client reserves this many next time
                if pieces and needed < slots:  # room for them: each piece one return value, inlined by Ray
                    passed, sent = chunked, pieces
            reply = blob if passed is None and type(blob) is bytes else [blob, passed, needed]
            if slots == 1:
                return reply
            return (reply, *sent, *[None] * (slots - 1 - len(sent)))

        async def add_fields_many(self, updates: dict[Key, Mapping[str, Any]]) -> int:
            await self.adopt(list(updates.values()))
            return self.queue.add_fields_many(updates)

        def _ack_first(self, lease_id: int | None, replica: ReplicaSet | None) -> None:
            """Ack the batch a get carries (the reader's previous one) before leasing the next."""
            if lease_id is not None:
                self.queue.ack(lease_id, rank=None if replica is None else replica.rank)

        async def get(self, request: bytes) -> Any:
            task, fields, n, batcher, timeout, replica, ack, after, _, lease_s = load_request(request)
            await self._after(after)
            check_get_arguments(task, n, lease_s)
            self._ack_first(ack, replica)
            batch = await self.aqueue.get(
                task, fields=fields, n=n, batcher=batcher, timeout=timeout, replica=replica, lease_s=lease_s
            )
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
            return pack((batch.task, batch.lease_id, rows, batch.lease_timeout_s, batch.version))

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


def _writeable(array: Any) -> bool:
    """Whether an array owns writeable memory (numpy ``flags.writeable``; other array types: assumed)."""
    flags = getattr(array, "flags", None)
    return bool(getattr(flags, "writeable", True))
