"""relax_queue: a bounded, version-tagged, columnar data bus with staleness control.

Producers put rows (key, fields, policy versions, group, tags) and add fields later; readers of
each task (consumer group) lease batches, ack or nack them; a staleness policy paces producers
(admission) and checks rows at consumption. Works in-process (threads and asyncio) and across a
Ray cluster, with no third-party dependency at import time.
"""

from relax_queue._async import AsyncReader, AsyncTransferQueue
from relax_queue._batchers import Batcher, FixedSizeBatcher, GroupBatcher, RowMeta, TokenBudgetBatcher
from relax_queue._config import BoundedStaleness, Capacity, OnStale, QueueConfig, StalenessPolicy, TaskSpec
from relax_queue._errors import (
    AdmissionError,
    ArgumentError,
    ConfigError,
    FieldTypeError,
    GroupDeadlockError,
    GroupError,
    LeaseError,
    QueueClosedError,
    QueueFullError,
    QueueTimeoutError,
    RelaxQueueError,
    RowTooLargeError,
    UnknownTaskError,
)
from relax_queue._payload import PLAIN_MODULES, Payload, is_plain
from relax_queue._protocols import QueueClient, QueueReader
from relax_queue._queue import Reader, TransferQueue, VersionError
from relax_queue._ray import RayQueueClient, RayReader, connect, create_ray_queue
from relax_queue._ray_group import create_ray_queues
from relax_queue._replica import ReplicaSet
from relax_queue._sizing import estimate_nbytes
from relax_queue._snapshot import snapshot_keys
from relax_queue._types import Batch, ColumnBatch, Key, RequeuedRow, Row, RowInput

__all__ = [  # noqa: RUF022 - grouped by topic
    # interfaces every transport implements
    "QueueClient",
    "QueueReader",
    # queues and readers
    "AsyncReader",
    "AsyncTransferQueue",
    "Reader",
    "TransferQueue",
    # configuration
    "BoundedStaleness",
    "Capacity",
    "OnStale",
    "QueueConfig",
    "StalenessPolicy",
    "TaskSpec",
    # rows and batches
    "Batch",
    "ColumnBatch",
    "Key",
    "RequeuedRow",
    "Row",
    "RowInput",
    # batching
    "Batcher",
    "FixedSizeBatcher",
    "GroupBatcher",
    "ReplicaSet",
    "RowMeta",
    "TokenBudgetBatcher",
    # Ray transport
    "RayQueueClient",
    "RayReader",
    "connect",
    "create_ray_queue",
    "create_ray_queues",
    # opaque payloads (values the queue moves without importing their modules)
    "PLAIN_MODULES",
    "Payload",
    "is_plain",
    # utilities
    "estimate_nbytes",
    "snapshot_keys",
    # errors
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
