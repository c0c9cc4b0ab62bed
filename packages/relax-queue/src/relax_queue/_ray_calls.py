"""What the Ray client does around its actor calls: a get's request, errors unwrapped, replies decoded.

``ray`` is imported only inside functions.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any, cast

from relax_queue._batchers import Batcher, FixedSizeBatcher
from relax_queue._payload import open_payloads
from relax_queue._ray_actor import ray_module
from relax_queue._replica import ReplicaSet
from relax_queue._types import Batch, ColumnBatch, Row
from relax_queue._wire import MAX_REPLY_SLOTS, StoreRef, join_columns, may_hold_refs, unchunk, unpack, unpack_column

__all__ = ["decode_batch", "decode_columns", "get_request", "resolve", "unwrap"]


def resolve(values: list[StoreRef]) -> list[Any]:
    """The values ``values`` stand for, each object fetched once in one ``ray.get``."""
    objects = list(dict.fromkeys(v.ref for v in values))
    fetched = dict(zip(objects, ray_module().get(objects), strict=True))
    return [v.pick(fetched[v.ref]) for v in values]


def get_request(
    task: str,
    fields: tuple[str, ...] | None,
    n: int | None,
    batcher: Batcher | None,
    timeout: float | None,
    replica: ReplicaSet | None,
    ack: int | None,
    after: tuple[str, int] | None = None,
    slots: int = 1,
    lease_s: float | None = None,
) -> bytes:
    """A get's arguments as one bytes object: Ray serialises each argument of a call on its own
    (≈ 0.2 ms for a get's seven here), one pickled blob costs one.

    The package's own batchers and replica sets are pickled by reference with plain pickle (5 µs); any
    other batcher goes through cloudpickle (0.17-0.34 ms a get here, the largest part of a single-row get's
    own work), so classes Ray would ship by value (defined in ``__main__`` or a notebook) still travel.
    """
    chosen = batcher or FixedSizeBatcher()
    args = (task, fields, n, chosen, timeout, replica, ack, after, slots, lease_s)
    if type(chosen).__module__ in _OWN_MODULES and (replica is None or type(replica) is ReplicaSet):
        return pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL)
    return cast(bytes, ray_module().cloudpickle.dumps(args))


# Modules whose classes every queue process imports by name (plain pickle's by-reference form is enough).
_OWN_MODULES = frozenset(("relax_queue._batchers", "relax_queue._replica"))


def unwrap(refs: Any) -> Any:
    """``ray.get`` that re-raises the queue's own exception instead of Ray's wrapper."""
    ray = ray_module()
    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as err:
        cause = getattr(err, "cause", None)
        if isinstance(cause, BaseException):
            raise cause from None
        raise


def decode_batch(task: str, lease_id: int, wire: list[Any], lease_timeout_s: float, version: int) -> Batch:
    """The rows of a get's reply, object-store values fetched (in one ``ray.get``) and payloads opened."""
    batch = Batch(task, lease_id, [Row(*item) for item in wire], lease_timeout_s, version)
    slots = [(row.fields, name, v) for row in batch.rows for name, v in row.fields.items() if isinstance(v, StoreRef)]
    if slots:
        for (row_fields, name, _), value in zip(slots, resolve([v for _, _, v in slots]), strict=True):
            row_fields[name] = value
    open_payloads((row.fields for row in batch.rows), dict.items)
    return batch


def decode_columns(reply: Any, pieces: Sequence[Any], reply_slots: dict[str, int], task: str) -> ColumnBatch:
    """The batch of a ``get_columns`` reply (its first return value) and the ``pieces`` of chunked columns
    (the others); records in ``reply_slots[task]`` how many return values the task's next get asks for."""
    head, passed, needed = (reply, None, 0) if type(reply) is bytes else reply
    # The next get of this task reserves return values for as many pieces as this reply had.
    reply_slots[task] = min(needed + 1, MAX_REPLY_SLOTS)
    wire = unpack(head)
    n_rows = len(wire[2])
    v_min, v_max, group_ids, group_sizes, tags, staleness, stale, deliveries = (
        unpack_column(column, n_rows) for column in wire[4:12]
    )
    batch = ColumnBatch(
        wire[0],
        wire[1],
        wire[2],
        unchunk(join_columns(wire[3], passed), pieces),
        v_min,
        v_max,
        group_ids,
        group_sizes,
        tags,
        staleness,
        stale,
        deliveries,
        wire[12],
        wire[13],
    )
    slots = [
        (column, i, value)
        for column in batch.columns.values()
        if type(column) is list and may_hold_refs(column)
        for i, value in enumerate(column)
        if isinstance(value, StoreRef)
    ]
    if slots:
        for (column, i, _), value in zip(slots, resolve([v for _, _, v in slots]), strict=True):
            column[i] = value
    open_payloads((c for c in batch.columns.values() if type(c) is list and may_hold_refs(c)), enumerate)
    return batch
