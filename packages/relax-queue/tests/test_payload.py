"""Opaque payloads: values of classes a queue process cannot (or should not) import cross the queue as bytes.

The Ray test puts objects of a class whose module only the driver can import: before payloads, the actor
failed to unpickle the call (the module is not on its path); now it holds bytes, counts their exact length, and
the consumer gets equal objects back, the ones several rows shared still shared.
"""

from __future__ import annotations

import pickle
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from relax_queue import (
    Capacity,
    FixedSizeBatcher,
    Payload,
    QueueConfig,
    RowInput,
    TaskSpec,
    TransferQueue,
    create_ray_queue,
    is_plain,
)
from relax_queue._payload import PayloadPacker, open_payloads

np = pytest.importorskip("numpy")


class Opaque:
    """A value of a class outside PLAIN_MODULES (this test module)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.n == self.n

    def __hash__(self) -> int:
        return self.n


@pytest.mark.parametrize(
    ("value", "plain"),
    [
        (3, True),
        ("s", True),
        (b"b", True),
        (None, True),
        ([1, 2.5, "x"], True),
        ({"a": [1, {"b": (2, 3)}]}, True),
        (frozenset({1, 2}), True),
        (np.zeros((2, 3), np.float32), True),
        (np.float32(1.5), True),
        (np.array([Opaque(1)], dtype=object), False),  # an object array may hold anything
        (Opaque(1), False),
        ([1, Opaque(1)], False),
        ({"meta": {"x": Opaque(1)}}, False),
        ({Opaque(1)}, False),
    ],
)
def test_plain_values_are_builtins_numpy_and_their_containers(value: object, plain: bool) -> None:
    assert is_plain(value) is plain


def test_a_value_shared_by_rows_is_packed_and_opened_once() -> None:
    shared, other = Opaque(7), Opaque(8)
    packer = PayloadPacker()
    rows = [packer.pack_fields({"x": shared, "k": 1}), packer.pack_fields({"x": shared}), {"x": packer.pack(other)}]
    assert rows[0]["x"] is rows[1]["x"] and type(rows[0]["x"]) is Payload
    assert rows[0]["x"].nbytes == len(pickle.dumps(shared, protocol=5))
    plain = {"k": [1, 2]}
    assert packer.pack_fields(plain) is plain  # nothing to pack: the same mapping, no copy
    received = pickle.loads(pickle.dumps(rows))  # as a message carries them
    open_payloads(received, dict.items)
    assert received[0]["x"] == shared and received[0]["x"] is received[1]["x"] and received[2]["x"] == other
    assert received[0]["k"] == 1


def test_in_process_snapshot_holds_payloads_and_loads_values(tmp_path: Path) -> None:
    config = QueueConfig(tasks=(TaskSpec("t"),), capacity=Capacity(max_bytes=1 << 20))
    queue = TransferQueue(config)
    shared = Opaque(5)
    queue.put_many([RowInput(f"k{i}", {"x": shared, "n": i}) for i in range(3)])
    path = tmp_path / "q.pkl"
    queue.save(path)
    state = pickle.loads(path.read_bytes())
    stored = [row["fields"]["x"] for row in state["rows"]]
    assert all(type(v) is Payload for v in stored) and stored[0] is stored[1]  # packed once, shared in the file
    restored = TransferQueue(config)
    restored.load(path)
    batch = restored.reader("t", ["x", "n"], FixedSizeBatcher(3)).get(timeout=1)
    assert [r.fields["x"] for r in batch.rows] == [shared] * 3 and [r.fields["n"] for r in batch.rows] == [0, 1, 2]
    kept = TransferQueue(config)
    kept.load(path, open_payloads=False)  # what a queue actor does: the bytes stay bytes
    assert type(kept.reader("t", ["x"]).get(1, timeout=1).rows[0].fields["x"]) is Payload


_MODULE = textwrap.dedent(
    """
    class Blob:
        def __init__(self, data):
            self.data = data

        def __eq__(self, other):
            return type(other).__name__ == "Blob" and other.data == self.data
    """
)


@pytest.mark.integration
def test_ray_actor_holds_values_of_a_module_it_cannot_import(ray_session: Any, tmp_path: Path) -> None:
    (tmp_path / "driver_only_blobs.py").write_text(_MODULE, encoding="utf-8")
    sys.path.insert(0, str(tmp_path))  # the driver's path only: the actor's worker cannot import the module
    try:
        import driver_only_blobs

        small, large = driver_only_blobs.Blob("s" * 10), driver_only_blobs.Blob(bytes(100_000))
        config = QueueConfig(tasks=(TaskSpec("t"),), capacity=Capacity(max_bytes=1 << 24))
        client = create_ray_queue("payload-test", config)
        try:
            client.put_many([RowInput("a", {"v": small, "n": 1}), RowInput("b", {"v": small, "n": 2})])
            client.put_columns(["c"], {"v": [large], "n": [3]})
            expected = 2 * len(pickle.dumps(small, protocol=5)) + len(pickle.dumps(large, protocol=5)) + 3 * 8
            assert client.metrics()["depth_bytes"] == expected  # exact: each payload's length, 8 a scalar
            saved = tmp_path / "q.pkl"
            client.save(str(saved))
            client.load(str(saved))
            batch = client.reader("t", ["v", "n"], FixedSizeBatcher(3)).get(timeout=10)
            by_key = {r.key: r.fields["v"] for r in batch.rows}
            assert by_key == {"a": small, "b": small, "c": large}
            assert by_key["a"] is by_key["b"]  # one object the two rows shared, shared again
            columns = client.reader("t", ["v"], FixedSizeBatcher(3))
            client.reader("t").nack(batch)
            assert columns.get_columns(timeout=10).columns["v"] == [small, small, large]
        finally:
            client.shutdown()
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("driver_only_blobs", None)
