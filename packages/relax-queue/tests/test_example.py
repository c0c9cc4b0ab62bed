"""The non-RL example runs end to end and its outputs match an independent computation."""

from __future__ import annotations

import importlib.util
import zlib
from pathlib import Path
from types import ModuleType

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "etl_pipeline.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("etl_pipeline", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_etl_example_index_and_archive_are_exact() -> None:
    example = _load()
    docs = example.make_documents(120, seed=3)
    result = example.run_pipeline(docs, max_rows=8, seed=1)
    expected_index: dict[str, set[str]] = {}
    for key, raw in docs.items():
        for word in raw.decode().split():
            expected_index.setdefault(word, set()).add(key)
    assert result["index"] == expected_index
    assert {k: zlib.decompress(v) for k, v in result["archive"].items()} == docs
    m = result["metrics"]
    assert m["depth_rows"] == 0 and m["freed"] == 120
    assert m["put_waits"] > 0  # 120 documents through 8 rows of capacity: the crawler was paced
    assert m["redeliveries"] > 0  # the flaky archiver's nacked batches came back
    assert m["tasks"]["archive"]["acked"] == 120
