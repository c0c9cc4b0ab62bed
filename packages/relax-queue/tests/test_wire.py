"""Wire forms of the Ray transport (``_wire``), without Ray: one pickle for a call's small parts."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from relax_queue._wire import (
    CHUNK_BYTES,
    CHUNKED_MAX_BYTES,
    INLINE_ARRAY_BYTES,
    Chunks,
    StoreRef,
    chunk_arrays,
    join_columns,
    pack,
    split_columns,
    unchunk,
    unpack,
)

np = pytest.importorskip("numpy")


def _payload() -> tuple[Any, ...]:
    keys = [(pid, i, j) for pid in range(2) for i in range(3) for j in range(5)]  # tuple keys, as producers use
    columns = {"reward": np.arange(30, dtype=np.float32), "text": [f"row {i}" for i in range(30)]}
    return keys, columns, {"v_min": None, "admitted": False, "timeout": None}


def test_a_payload_of_plain_values_travels_as_one_pickle_and_comes_back_equal() -> None:
    wire = pack(_payload())
    assert type(wire) is bytes
    keys, columns, options = unpack(wire)
    want_keys, want_columns, want_options = _payload()
    assert keys == want_keys and all(type(k) is tuple for k in keys)
    np.testing.assert_array_equal(columns["reward"], want_columns["reward"])
    assert columns["reward"].dtype == np.float32 and columns["reward"].flags.writeable  # a copy of its own
    assert columns["text"] == want_columns["text"] and options == want_options


def test_a_payload_plain_pickle_refuses_or_that_names_ray_goes_through_rays_serialiser() -> None:
    local = [lambda x: x + 1]  # plain pickle cannot pickle a lambda; Ray's cloudpickle can
    payload = (["k"], {"f": local}, {})
    assert pack(payload) is payload
    # A string naming a Ray module looks like a Ray object in the pickle: the slower, always-correct way.
    marked = (["k"], {"path": ["x-ray.png"]}, {})
    assert pack(marked) is marked
    assert unpack(marked) is marked  # what is not bytes is used as it came


def test_split_passes_large_arrays_and_reference_columns_and_join_restores_order() -> None:
    small = np.zeros(INLINE_ARRAY_BYTES // 8 - 1)  # one element under the bound
    large = np.zeros(INLINE_ARRAY_BYTES // 8)  # exactly at it
    refs = [1.0, StoreRef(object(), 10**6), 2.0]
    columns = {"a": small, "b": large, "c": [1, 2, 3], "d": refs, "e": [(1, 2), (3, 4), (5, 6)]}
    inline, passed = split_columns(columns)
    assert passed is not None and set(passed) == {"b", "d"}
    assert passed["b"] is large and passed["d"] is refs
    assert list(inline) == ["a", "b", "c", "d", "e"] and inline["b"] is None and inline["d"] is None
    assert inline["a"] is small
    joined = join_columns(pickle.loads(pickle.dumps(inline)), passed)
    assert list(joined) == list(columns)
    assert joined["b"] is large and joined["d"] is refs and joined["e"] == columns["e"]
    np.testing.assert_array_equal(joined["a"], small)


def test_split_of_small_columns_passes_nothing() -> None:
    columns = {"x": np.ones(4), "y": ["a", "b", "c", "d"]}
    inline, passed = split_columns(columns)
    assert passed is None and inline is columns
    assert join_columns(inline, None) is columns


def test_mid_size_numpy_columns_travel_as_pieces_under_the_inline_limit_and_join_equal() -> None:
    rng = np.random.default_rng(0)
    passed = {
        "obs": rng.random((1000, 32), dtype=np.float32),  # 128 KB: 2 pieces of 512 rows (64 KiB each)
        "act": rng.random((1000, 7))[::-1],  # 56 KB, a reversed (non-contiguous) view: 1 piece
        "img": rng.integers(0, 255, (3, 200, 200, 3), dtype=np.uint8),  # 120 kB rows: too large to cut
        "huge": np.zeros((CHUNKED_MAX_BYTES // 8 + 1,)),  # over the budget: whole, through the object store
        "refs": [StoreRef(object(), 10)],
    }
    chunked, pieces = chunk_arrays(passed, first=1)
    assert type(chunked["obs"]) is Chunks and (chunked["obs"].start, chunked["obs"].count) == (1, 2)
    assert type(chunked["act"]) is Chunks and (chunked["act"].start, chunked["act"].count) == (3, 1)
    assert chunked["img"] is passed["img"] and chunked["huge"] is passed["huge"] and chunked["refs"] is passed["refs"]
    assert len(pieces) == 3 and all(len(pickle.dumps(p, protocol=5)) < 100 * 1024 for p in pieces)
    assert [len(p) for p in pieces] == [CHUNK_BYTES // 128, 1000 - CHUNK_BYTES // 128, 1000]
    # What arrives: the markers and pieces pickled apart, as Ray sends them; joined in their order.
    arrived = {name: pickle.loads(pickle.dumps(c)) for name, c in chunked.items() if name != "refs"}
    joined = unchunk(arrived, [None] + [pickle.loads(pickle.dumps(p)) for p in pieces])
    for name in ("obs", "act", "img", "huge"):
        np.testing.assert_array_equal(joined[name], passed[name])
        assert joined[name].dtype == passed[name].dtype
    assert joined["obs"].flags.writeable  # joined from two pieces: an array of its own


def test_columns_that_cannot_be_cut_are_left_whole() -> None:
    passed = {"scalar": np.float64(3.0), "empty": np.zeros((0, 4)), "list": [1, 2]}
    chunked, pieces = chunk_arrays(passed)
    assert chunked is passed and pieces == []
