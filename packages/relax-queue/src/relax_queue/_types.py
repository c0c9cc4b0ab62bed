"""Rows going in (:class:`RowInput`), rows and batches coming out (:class:`Row`, :class:`Batch`)."""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from relax_queue._errors import FieldTypeError

__all__ = ["Batch", "ColumnBatch", "Key", "RequeuedRow", "Row", "RowInput", "Tags"]

Key = Hashable
"""A row key: any hashable value (str or int recommended; it must pickle for snapshots and Ray)."""

Tags = Mapping[str, "int | float | str"]
"""Small scalar metadata of a row, e.g. ``{"num_tokens": 37, "prompt_id": "p12"}``."""


@dataclass(frozen=True, slots=True)
class RowInput:
    """One row to put.

    Attributes:
        key: unique row key; putting a key that is already stored only adds missing fields.
        fields: columns of the row (any Python objects; arrays and tensors are stored by reference).
        versions: ``(v_min, v_max)``, the oldest and newest policy version that produced the row;
            an int ``v`` means ``(v, v)`` (ints >= 0; numpy integers are taken as ints). ``None``:
            ``(0, 0)`` for a new row; for a stored key, the stored versions (given ones must match).
        group_id: id of the group (e.g. the GRPO prompt) the row belongs to, or ``None``.
        group_size: number of rows in the group; required with ``group_id``.
        tags: scalar metadata used by batchers (e.g. ``num_tokens``) and by producers.
    """

    key: Key
    fields: Mapping[str, Any]
    versions: tuple[int, int] | int | None = None
    group_id: Hashable | None = None
    group_size: int | None = None
    tags: Tags = field(default_factory=dict)


@dataclass(slots=True)
class Row:
    """A delivered row.

    Attributes:
        key: the row key.
        fields: the fields the reader asked for (all stored fields if it asked for ``None``).
        v_min: oldest policy version in the row.
        v_max: newest policy version in the row.
        group_id: group of the row or ``None``.
        group_size: size of that group or ``None``.
        tags: the row's tags.
        staleness: ``V - v_min`` at delivery, V being the published version then.
        stale: ``True`` only when the row exceeded τ and the policy's action is ``flag``.
        deliveries: how many times this row has been delivered to this task (1 on first delivery).
    """

    key: Key
    fields: dict[str, Any]
    v_min: int
    v_max: int
    group_id: Hashable | None
    group_size: int | None
    tags: Tags
    staleness: int
    stale: bool
    deliveries: int


@dataclass(frozen=True, slots=True)
class Batch:
    """Rows delivered to one task under one lease. ``ack`` it to consume, ``nack`` to redeliver.

    Attributes:
        task: the task the batch was delivered to.
        lease_id: id of the lease; unique for the life of the queue (also across restores).
        rows: the rows, whole groups only, in delivery order.
        lease_timeout_s: seconds the lease lasts from delivery unless renewed.
        version: the published policy version at delivery.
    """

    task: str
    lease_id: int
    rows: list[Row]
    lease_timeout_s: float
    version: int

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[Row]:
        return iter(self.rows)

    @property
    def keys(self) -> list[Key]:
        """Keys of the rows, in order."""
        return [r.key for r in self.rows]

    def column(self, name: str) -> list[Any]:
        """Values of field ``name`` over the rows, in order.

        Raises:
            KeyError: when the reader did not ask for ``name``.
        """
        try:
            return [r.fields[name] for r in self.rows]
        except KeyError:
            raise KeyError(f"field {name!r} is not in this batch; the reader must list it in fields=") from None


@dataclass(frozen=True, slots=True)
class ColumnBatch:
    """Rows delivered to one task under one lease, as columns (what ``get_columns`` returns).

    Every list has one entry per row, in delivery order; entry ``i`` of each describes the row
    ``keys[i]`` exactly as :class:`Row` would. ``ack`` / ``nack`` it like a :class:`Batch`.

    Attributes:
        task: the task the batch was delivered to.
        lease_id: id of the lease; unique for the life of the queue (also across restores).
        keys: the row keys.
        columns: field name to the values of that field, one per row (the reader's fields; with
            ``fields=None``, every field of the rows, which must then all carry the same fields): a
            list, or a slice of the array put by ``put_columns`` when every row of the batch came
            from that one put, in order (no per-row views restacked).
        v_min: oldest policy version of each row.
        v_max: newest policy version of each row.
        group_ids: group of each row or ``None``.
        group_sizes: size of that group or ``None``.
        tags: tags of each row.
        staleness: ``V - v_min`` of each row at delivery.
        stale: ``True`` where the row exceeded τ and the policy's action is ``flag``.
        deliveries: how many times each row has been delivered to this task.
        lease_timeout_s: seconds the lease lasts from delivery unless renewed.
        version: the published policy version at delivery.
    """

    task: str
    lease_id: int
    keys: list[Key]
    columns: dict[str, Any]
    v_min: list[int]
    v_max: list[int]
    group_ids: list[Hashable | None]
    group_sizes: list[int | None]
    tags: list[Tags]
    staleness: list[int]
    stale: list[bool]
    deliveries: list[int]
    lease_timeout_s: float
    version: int

    def __len__(self) -> int:
        return len(self.keys)

    def column(self, name: str) -> Any:
        """Values of field ``name``, one per row (a list, or an array slice; see ``columns``).

        Raises:
            KeyError: when the reader did not ask for ``name``.
        """
        try:
            return self.columns[name]
        except KeyError:
            raise KeyError(f"field {name!r} is not in this batch; the reader must list it in fields=") from None

    def to_batch(self) -> Batch:
        """The same delivery as a row-wise :class:`Batch` (same lease)."""
        names = list(self.columns)
        rows = [
            Row(key, dict(zip(names, values, strict=True)), *meta)
            for key, values, *meta in zip(
                self.keys,
                zip(*self.columns.values(), strict=True) if names else [()] * len(self.keys),
                self.v_min,
                self.v_max,
                self.group_ids,
                self.group_sizes,
                self.tags,
                self.staleness,
                self.stale,
                self.deliveries,
                strict=True,
            )
        ]
        return Batch(self.task, self.lease_id, rows, self.lease_timeout_s, self.version)

    @classmethod
    def from_batch(cls, batch: Batch) -> ColumnBatch:
        """The same delivery as columns; the rows must all carry the same fields."""
        rows = batch.rows
        names = list(rows[0].fields) if rows else []
        for row in rows:
            if row.fields.keys() != set(names):
                raise FieldTypeError(
                    f"rows of lease {batch.lease_id} carry different fields ({names} and {list(row.fields)}); "
                    "name the fields the reader needs to get them as columns"
                )
        return cls(
            batch.task,
            batch.lease_id,
            [r.key for r in rows],
            {name: [r.fields[name] for r in rows] for name in names},
            [r.v_min for r in rows],
            [r.v_max for r in rows],
            [r.group_id for r in rows],
            [r.group_size for r in rows],
            [r.tags for r in rows],
            [r.staleness for r in rows],
            [r.stale for r in rows],
            [r.deliveries for r in rows],
            batch.lease_timeout_s,
            batch.version,
        )


@dataclass(frozen=True, slots=True)
class RequeuedRow:
    """A row removed as stale under ``on_stale="requeue"``: the producer should regenerate it.

    The key is not retired, so the producer may put a fresh row under the same key.

    Attributes:
        key: the row key.
        group_id: its group or ``None`` (a stale group is requeued whole).
        group_size: that group's size or ``None``.
        tags: the row's tags (a good place for the prompt id a producer needs to regenerate).
        v_min: the row's oldest version.
        version: the published version when it was found stale.
    """

    key: Key
    group_id: Hashable | None
    group_size: int | None
    tags: Tags
    v_min: int
    version: int
