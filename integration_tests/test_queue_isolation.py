"""relax-queue must import and work where torch, numpy and ray are absent.

The check runs in a fresh interpreter with an import hook that refuses those modules, so an
accidental import anywhere in relax_queue (at import time or inside put/get/ack, admission,
snapshots, metrics or the asyncio face) fails this test.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

QUEUE_SRC = Path(__file__).resolve().parents[1] / "packages" / "relax-queue" / "src"

_SCRIPT = textwrap.dedent(
    """
    import importlib.abc
    import sys

    BLOCKED = {"torch", "numpy", "ray"}

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"blocked import of {name}")
            return None

    sys.meta_path.insert(0, Blocker())
    sys.path.insert(0, sys.argv[1])
    import relax_queue

    import asyncio
    import tempfile
    from relax_queue import (
        AsyncTransferQueue, BoundedStaleness, Capacity, GroupBatcher, QueueConfig, RowInput, TaskSpec,
        TransferQueue,
    )

    q = TransferQueue(QueueConfig(
        tasks=(TaskSpec("reward"), TaskSpec("trainer", check_staleness=True)),
        capacity=Capacity(max_rows=64, max_bytes=1 << 20),
        staleness=BoundedStaleness(tau=1, on_stale="requeue", batch_size=4),
    ))
    assert q.admit(8) == 8
    q.put_many([RowInput(f"k{i}", {"tokens": bytes(10)}, versions=0, group_id=f"g{i // 2}", group_size=2,
                         tags={"num_tokens": 10}) for i in range(8)], admitted=True)
    reward = q.reader("reward", ["tokens"], GroupBatcher(2))
    batch = reward.get(timeout=1)
    q.add_fields_many({k: {"reward": 1.0} for k in batch.keys})
    reward.ack(batch)
    trainer = q.reader("trainer", ["tokens", "reward"], GroupBatcher(2))
    tb = trainer.get(timeout=1)
    assert sorted(tb.keys) == ["k0", "k1", "k2", "k3"], tb.keys
    trainer.nack(tb)
    trainer.ack(trainer.get(timeout=1))
    with tempfile.TemporaryDirectory() as tmp:
        q.save(tmp + "/q.pkl")
        q2 = TransferQueue(q.config)
        q2.load(tmp + "/q.pkl")
    assert len(q2) == 4
    q2.publish_version(5)
    aq = AsyncTransferQueue(q2)
    rest = asyncio.run(aq.get("reward", fields=("tokens",), n=4, timeout=1))
    q2.add_fields_many({k: {"reward": 0.0} for k in rest.keys})
    aq.ack(rest)
    try:
        trainer2 = q2.reader("trainer", ["tokens", "reward"])
        trainer2.get(1, timeout=0.05)
        raise AssertionError("stale rows were delivered")
    except relax_queue.QueueTimeoutError:
        pass
    assert len(q2.take_requeued()) == 4
    m = q2.metrics()
    assert m["requeues"] == 4 and m["depth_rows"] == 0, m

    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not loaded, loaded
    print("OK", relax_queue.__name__)
    """
)


def test_relax_queue_imports_without_ml_dependencies() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(QUEUE_SRC)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith("OK relax_queue")
