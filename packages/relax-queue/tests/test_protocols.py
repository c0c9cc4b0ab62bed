"""A new transport is one class implementing ``QueueClient`` / ``QueueReader``, checked by the type checker.

``ForwardingQueue`` below is a second transport (it forwards every call to a queue it wraps, as an RPC or
logging layer would). mypy checks this file against the protocols; a copy with one drifted signature fails.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Hashable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from relax_queue import (
    Batch,
    Batcher,
    ColumnBatch,
    FixedSizeBatcher,
    Key,
    QueueClient,
    QueueReader,
    RequeuedRow,
    RowInput,
    TaskSpec,
    TransferQueue,
)
from relax_queue._replica import ReplicaSet


class ForwardingReader:
    """A reader of a :class:`ForwardingQueue` (forwards to the wrapped queue's reader)."""

    def __init__(self, inner: QueueReader, log: list[str]) -> None:
        self.inner, self.log = inner, log

    def get(
        self,
        n: int | None = None,
        timeout: float | None = None,
        *,
        ack: Batch | ColumnBatch | None = None,
        lease_s: float | None = None,
    ) -> Batch:
        self.log.append("reader.get")
        return self.inner.get(n, timeout, ack=ack, lease_s=lease_s)

    def get_columns(
        self,
        n: int | None = None,
        timeout: float | None = None,
        *,
        ack: Batch | ColumnBatch | None = None,
        lease_s: float | None = None,
    ) -> ColumnBatch:
        return self.inner.get_columns(n, timeout, ack=ack, lease_s=lease_s)

    def ack(self, batch: Batch | ColumnBatch) -> None:
        self.log.append("reader.ack")
        self.inner.ack(batch)

    def ack_and_publish(self, batch: Batch | ColumnBatch, version: int) -> None:
        self.inner.ack_and_publish(batch, version)

    def nack(self, batch: Batch | ColumnBatch) -> None:
        self.inner.nack(batch)

    def renew(self, batch: Batch | ColumnBatch, timeout_s: float | None = None) -> None:
        self.inner.renew(batch, timeout_s)


class ForwardingQueue:
    """A transport that forwards every call to another queue, recording the calls it made."""

    def __init__(self, inner: QueueClient) -> None:
        self.inner = inner
        self.log: list[str] = []

    def put(
        self,
        key: Key,
        fields: Mapping[str, Any],
        *,
        versions: tuple[int, int] | int = 0,
        group_id: Hashable | None = None,
        group_size: int | None = None,
        tags: Mapping[str, int | float | str] | None = None,
        admitted: bool = False,
        timeout: float | None = None,
    ) -> None:
        self.log.append("put")
        self.inner.put(
            key,
            fields,
            versions=versions,
            group_id=group_id,
            group_size=group_size,
            tags=tags,
            admitted=admitted,
            timeout=timeout,
        )

    def put_many(self, rows: Sequence[RowInput], *, admitted: bool = False, timeout: float | None = None) -> None:
        self.log.append("put_many")
        self.inner.put_many(rows, admitted=admitted, timeout=timeout)

    def put_columns(
        self,
        keys: Sequence[Key],
        columns: Mapping[str, Sequence[Any]],
        *,
        v_min: int | Sequence[int] = 0,
        v_max: int | Sequence[int] | None = None,
        group_ids: Sequence[Hashable | None] | None = None,
        group_sizes: int | Sequence[int | None] | None = None,
        tags: Mapping[str, Sequence[int | float | str]] | None = None,
        admitted: bool = False,
        timeout: float | None = None,
    ) -> None:
        self.inner.put_columns(
            keys,
            columns,
            v_min=v_min,
            v_max=v_max,
            group_ids=group_ids,
            group_sizes=group_sizes,
            tags=tags,
            admitted=admitted,
            timeout=timeout,
        )

    def add_fields(self, key: Key, fields: Mapping[str, Any]) -> bool:
        return self.inner.add_fields(key, fields)

    def add_fields_many(self, updates: Mapping[Key, Mapping[str, Any]]) -> int:
        self.log.append("add_fields_many")
        return self.inner.add_fields_many(updates)

    def reader(
        self,
        task: str,
        fields: Iterable[str] | None = None,
        batcher: Batcher | None = None,
        *,
        replica: ReplicaSet | None = None,
    ) -> ForwardingReader:
        return ForwardingReader(self.inner.reader(task, fields, batcher, replica=replica), self.log)

    def get(
        self,
        task: str,
        *,
        fields: tuple[str, ...] | None = None,
        n: int | None = None,
        batcher: Batcher | None = None,
        timeout: float | None = None,
        replica: ReplicaSet | None = None,
        lease_s: float | None = None,
    ) -> Batch:
        return self.inner.get(
            task, fields=fields, n=n, batcher=batcher, timeout=timeout, replica=replica, lease_s=lease_s
        )

    def ack(self, batch: Batch | ColumnBatch | int, *, rank: int | None = None) -> None:
        self.inner.ack(batch, rank=rank)

    def nack(self, batch: Batch | ColumnBatch | int) -> None:
        self.inner.nack(batch)

    def renew(self, batch: Batch | ColumnBatch | int, timeout_s: float | None = None) -> None:
        self.inner.renew(batch, timeout_s)

    @property
    def version(self) -> int:
        return self.inner.version

    def publish_version(self, version: int) -> None:
        self.inner.publish_version(version)

    def ack_and_publish(self, batch: Batch | ColumnBatch | int, version: int, *, rank: int | None = None) -> None:
        self.inner.ack_and_publish(batch, version, rank=rank)

    def admit(self, n: int, timeout: float = 0.0) -> int:
        return self.inner.admit(n, timeout)

    def release_admission(self, n: int = 1, *, failed: bool = False) -> None:
        self.inner.release_admission(n, failed=failed)

    def refund_admission(self, n: int) -> None:
        self.inner.refund_admission(n)

    def admission_capacity(self) -> int | None:
        return self.inner.admission_capacity()

    def take_requeued(self, max_n: int | None = None) -> list[RequeuedRow]:
        return self.inner.take_requeued(max_n)

    def save(self, path: str) -> None:
        self.inner.save(path)

    def load(self, path: str, *, reset_running: bool = True) -> None:
        self.inner.load(path, reset_running=reset_running)

    def ready(self, task: str, fields: Sequence[str] | None = None) -> int:
        return self.inner.ready(task, fields)

    def metrics(self) -> dict[str, Any]:
        return self.inner.metrics()

    def __len__(self) -> int:
        return len(self.inner)


def _as_client(queue: ForwardingQueue) -> QueueClient:  # mypy: the new transport implements the protocol
    return queue


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One mypy cache for this module's runs: the first checks relax-queue and the standard library and caches
    them, the second re-checks only its own file (each run alone takes seconds, most of them spent on those)."""
    return tmp_path_factory.mktemp("mypy-cache")


def _mypy(path: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    if shutil.which("mypy") is None and not Path(sys.executable).with_name("mypy").exists():
        pytest.skip("mypy is not installed")
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(cache), str(path)],
        capture_output=True,
        text=True,
        check=False,
    )


def test_the_new_transport_and_the_built_in_ones_pass_the_type_checker(mypy_cache: Path) -> None:
    result = _mypy(Path(__file__), mypy_cache)
    assert result.returncode == 0, result.stdout


def test_a_drifted_signature_is_caught_by_the_type_checker(tmp_path: Path, mypy_cache: Path) -> None:
    source = Path(__file__).read_text()
    good = "    def renew(self, batch: Batch | ColumnBatch | int, timeout_s: float | None = None) -> None:\n"
    assert source.count(good) == 1
    drifted = tmp_path / "drifted_transport.py"
    drifted.write_text(source.replace(good, "    def renew(self, batch: Batch | ColumnBatch | int) -> None:\n"))
    result = _mypy(drifted, mypy_cache)
    assert result.returncode == 1
    assert '"ForwardingQueue"' in result.stdout and '"QueueClient"' in result.stdout and "renew" in result.stdout


def test_the_new_transport_carries_rows_and_every_transport_is_a_queue_client() -> None:
    inner = TransferQueue(tasks=(TaskSpec("trainer"),))
    queue = ForwardingQueue(inner)
    assert isinstance(inner, QueueClient) and isinstance(queue, QueueClient)
    queue.put_many([RowInput("a", {"x": 1}), RowInput("b", {"x": 2})])
    queue.add_fields_many({"a": {"y": 10}})
    reader = queue.reader("trainer", fields=["x", "y"], batcher=FixedSizeBatcher(1))
    assert isinstance(reader, QueueReader)
    batch = reader.get(timeout=0)
    assert [(r.key, r.fields) for r in batch.rows] == [("a", {"x": 1, "y": 10})]  # only "a" has both fields
    reader.ack(batch)
    assert len(queue) == 1 and queue.ready("trainer", ["x"]) == 1
    assert queue.log == ["put_many", "add_fields_many", "reader.get", "reader.ack"]
