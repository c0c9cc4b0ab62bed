"""Pluggable batchers: which ready rows form the next batch of a task.

The queue hands a batcher the task's deliverable *units* in FIFO order (redeliveries first). A
unit is one ungrouped row or one complete group (all ``group_size`` rows present with the reader's
fields), so no batcher can split a group. The batcher returns the units to deliver, or ``None``
to wait for more.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from relax_queue._errors import ConfigError, FieldTypeError

__all__ = [
    "Batcher",
    "FixedSizeBatcher",
    "GroupBatcher",
    "RowMeta",
    "TokenBudgetBatcher",
]


class RowMeta(Protocol):
    """What a batcher may look at: a row's key, group and tags (never its payload)."""

    @property
    def key(self) -> Hashable: ...

    @property
    def group_id(self) -> Hashable | None: ...

    @property
    def group_size(self) -> int | None: ...

    @property
    def tags(self) -> Mapping[str, int | float | str]: ...


Unit = Sequence[RowMeta]


@runtime_checkable
class Batcher(Protocol):
    """Chooses the units of the next batch."""

    def select(self, units: Iterator[Unit], n: int | None) -> list[Unit] | None:
        """Pick units for one batch.

        Args:
            units: deliverable units of the task, FIFO; consume only as many as needed.
            n: the size the caller passed to ``get`` (its meaning is the batcher's unit of size),
                or ``None`` for the batcher's own default.

        Returns:
            The chosen units (non-empty), or ``None`` to wait for more rows.
        """
        ...


def _positive(name: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class FixedSizeBatcher:
    """Batches of exactly ``size`` rows (``get(n)`` overrides the size).

    Groups are packed whole in FIFO order, skipping a group that would overflow the batch; a group
    larger than the batch size is delivered alone rather than never.

    Attributes:
        size: rows per batch.
        partial: deliver whatever is ready (at least one unit) instead of waiting for a full batch.
    """

    size: int = 1
    partial: bool = False

    def __post_init__(self) -> None:
        _positive("FixedSizeBatcher.size", self.size)

    def select(self, units: Iterator[Unit], n: int | None) -> list[Unit] | None:
        """Take units until exactly ``n or size`` rows are chosen."""
        target = n or self.size
        taken: list[Unit] = []
        count = 0
        for unit in units:
            size = len(unit)
            if count + size > target:
                if not taken:
                    return [unit]
                continue
            taken.append(unit)
            count += size
            if count == target:
                return taken
        return taken if self.partial and taken else None


@dataclass(frozen=True)
class GroupBatcher:
    """Batches of ``groups`` complete groups (``get(n)`` means n groups); ungrouped rows count as one.

    Attributes:
        groups: groups per batch, e.g. the number of prompts of one GRPO update.
        partial: deliver whatever complete groups are ready instead of waiting for ``groups``.
    """

    groups: int = 1
    partial: bool = False

    def __post_init__(self) -> None:
        _positive("GroupBatcher.groups", self.groups)

    def select(self, units: Iterator[Unit], n: int | None) -> list[Unit] | None:
        """Take the first ``n or groups`` complete groups."""
        target = n or self.groups
        taken: list[Unit] = []
        for unit in units:
            taken.append(unit)
            if len(taken) == target:
                return taken
        return taken if self.partial and taken else None


@dataclass(frozen=True)
class TokenBudgetBatcher:
    """Batches filled up to a token budget read from a numeric tag, in FIFO order.

    A batch is ready when the next unit would overflow ``max_tokens`` (or ``max_rows`` is reached);
    a single unit above the budget is delivered alone. ``get(n)`` caps the rows at ``n``.

    Attributes:
        max_tokens: token budget per batch.
        tag: the row tag holding the row's token count.
        max_rows: optional cap on rows per batch.
        partial: deliver a non-empty batch below the budget instead of waiting.
    """

    max_tokens: int
    tag: str = "num_tokens"
    max_rows: int | None = None
    partial: bool = False

    def __post_init__(self) -> None:
        _positive("TokenBudgetBatcher.max_tokens", self.max_tokens)
        _positive("TokenBudgetBatcher.max_rows", self.max_rows, allow_none=True)

    def _tokens(self, unit: Unit) -> int:
        total = 0
        for row in unit:
            value = row.tags.get(self.tag)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise FieldTypeError(
                    f"TokenBudgetBatcher needs a numeric tag {self.tag!r} on every row; row {row.key!r} has {value!r}"
                )
            total += int(value)
        return total

    def select(self, units: Iterator[Unit], n: int | None) -> list[Unit] | None:
        """Take units while they fit the budget; ready once the next one does not."""
        row_cap = n if n is not None else self.max_rows
        taken: list[Unit] = []
        tokens = 0
        rows = 0
        for unit in units:
            unit_tokens = self._tokens(unit)
            if row_cap is not None and rows + len(unit) > row_cap:
                return taken or [unit]
            if tokens + unit_tokens > self.max_tokens:
                return taken or [unit]
            taken.append(unit)
            tokens += unit_tokens
            rows += len(unit)
            if tokens == self.max_tokens or rows == row_cap:
                return taken
        return taken if self.partial and taken else None
