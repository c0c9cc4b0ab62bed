"""Exceptions raised by relax_queue.

Every error names what was wrong (the task, key, field or limit) so the caller can act on it. An
error raised to one caller never changes the queue's state for anyone else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "AdmissionError",
    "ArgumentError",
    "ConfigError",
    "FieldTypeError",
    "GroupDeadlockError",
    "GroupError",
    "LeaseError",
    "QueueClosedError",
    "QueueFullError",
    "QueueTimeoutError",
    "RelaxQueueError",
    "RowTooLargeError",
    "UnknownTaskError",
    "VersionError",
]


class RelaxQueueError(Exception):
    """Base class of every error raised by relax_queue."""


class ConfigError(RelaxQueueError, ValueError):
    """A configuration value is invalid; the message names the field and the allowed values."""


class FieldTypeError(RelaxQueueError, TypeError):
    """A key, field name, version, group or tag passed to ``put`` has the wrong type or value."""


class GroupError(RelaxQueueError, ValueError):
    """Rows of one group disagree on the group size, or a group has more rows than its size."""


class UnknownTaskError(RelaxQueueError, KeyError):
    """A reader or ack named a task that was not registered in the queue config."""

    def __str__(self) -> str:  # KeyError would quote the whole message.
        return str(self.args[0]) if self.args else ""


class LeaseError(RelaxQueueError, KeyError):
    """An ack/nack/renew named a lease that is unknown, already settled, or expired."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class AdmissionError(RelaxQueueError, ValueError):
    """An admission was returned that was never granted (the running count would go negative)."""


class QueueTimeoutError(RelaxQueueError, TimeoutError):
    """A blocking call did not complete within its timeout."""


class QueueFullError(QueueTimeoutError):
    """A put waited ``timeout`` seconds for capacity and the queue stayed full.

    Attributes:
        inserted: keys of the rows that were stored before the timeout (puts are idempotent,
            so retrying the whole call is safe).
    """

    def __init__(self, message: str, inserted: Sequence[Any] = ()) -> None:
        super().__init__(message)
        self.inserted = list(inserted)


class GroupDeadlockError(QueueFullError, GroupError):
    """A put can never succeed: the bounded queue is full of incomplete groups.

    Readers take whole groups only, so no stored row can be delivered, acked and freed, and the
    rows that would complete the groups find no room. Raised at once instead of after the timeout;
    the message names the groups and the bound to raise.
    """


class RowTooLargeError(RelaxQueueError, ValueError):
    """A single row is larger than ``max_bytes`` and could never fit, however long it waited."""


class QueueClosedError(RelaxQueueError):
    """The queue was closed; blocked and later calls that change it fail with this error."""


class ArgumentError(RelaxQueueError, ValueError):
    """A call argument is outside its allowed values (e.g. a batch size ``n`` that is not an int >= 1)."""


class VersionError(RelaxQueueError, ValueError):
    """A published policy version is not an int or goes backwards."""
