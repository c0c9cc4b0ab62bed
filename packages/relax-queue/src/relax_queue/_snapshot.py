"""State dicts of a queue: plain Python containers, picklable, restorable.

Leases are not saved: a row leased but not acked at save time is pending again after restore (and
delivered first), so nothing in flight is lost.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relax_queue._core import QueueCore, RetiredKeys, StoredRow, field_value, fields_nbytes
from relax_queue._errors import ConfigError
from relax_queue._metrics import Counters

__all__ = ["FORMAT", "atomic_write", "core_state", "load_core_state", "read_state", "snapshot_keys"]

FORMAT = "relax_queue/1"


def core_state(core: QueueCore, resolve: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """Everything needed to rebuild ``core`` (caller holds the lock).

    Args:
        core: the queue state.
        resolve: maps each stored field value to what goes in the snapshot (the Ray transport
            fetches object-store references here); identity by default.
    """
    core.unblock()  # a snapshot lists stored rows
    leased: dict[str, set[Any]] = {name: set() for name in core.tasks}
    for lease in core.leases.values():
        # Matched to the stored row, not its key: a key requeued and put again is a new row.
        leased[lease.task.spec.name].update(r.key for r in core.live_rows(lease))
    rows = []
    for key, row in core.rows.items():
        todo, redeliver = [], []
        deliveries: dict[str, int] = {}
        for name, ts in core.tasks.items():
            if key in ts.retry or key in leased[name]:
                redeliver.append(name)
                deliveries[name] = ts.returned.get(key, 0) + (key in leased[name])
            elif key in ts.pending:
                todo.append(name)
        fields = {k: field_value(row, v) for k, v in row.fields.items()}  # segments saved as plain row values
        if resolve is not None:
            fields = {k: resolve(v) for k, v in fields.items()}
        rows.append(
            {
                "key": key,
                "fields": fields,
                "versions": (row.v_min, row.v_max),
                "group_id": row.group_id,
                "group_size": row.group_size,
                "tags": dict(row.tags),
                "nbytes": row.nbytes,
                "pending": todo,
                "redeliver": redeliver,
                "deliveries": deliveries,
            }
        )
    return {
        "format": FORMAT,
        "tasks": list(core.tasks),
        "version": core.version,
        "accepted": core.accepted,
        "running": core.running,
        "next_lease_id": core.next_lease_id,
        "rows": rows,
        "retired": list(core.retired),
        "requeued": list(core.requeued),
        "counters": core.counters.scalars(),
        "task_counters": {
            name: {"delivered": ts.delivered, "acked": ts.acked, "staleness_hist": dict(ts.staleness_hist)}
            for name, ts in core.tasks.items()
        },
    }


def load_core_state(core: QueueCore, state: dict[str, Any], reset_running: bool) -> None:
    """Replace ``core``'s state by ``state`` (caller holds the lock); leases become redeliveries."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ConfigError(f"not a relax_queue state dict (expected format {FORMAT!r})")
    unknown = [t for t in state["tasks"] if t not in core.tasks]
    if unknown:
        raise ConfigError(f"snapshot has tasks {unknown} that this queue does not register ({list(core.tasks)})")
    _check_fits(core, state["rows"])
    bounded = core.config.capacity.max_bytes is not None
    core.unblock()
    core.rows.clear()
    core.groups.clear()
    core.leases.clear()
    core.lease_heap.clear()
    core.nbytes = 0
    for ts in core.tasks.values():
        ts.pending.clear()
        ts.retry.clear()
        ts.returned.clear()
    redeliveries = 0
    # Tasks this queue registers that the snapshot did not know must still consume every row.
    extra = [t for t in core.tasks if t not in state["tasks"]]
    for item in state["rows"]:
        todo, redeliver = item["pending"], item["redeliver"]
        v_min, v_max = item["versions"]
        row = StoredRow(
            item["key"],
            dict(item["fields"]),
            v_min,
            v_max,
            item["group_id"],
            item["group_size"],
            item["tags"],
            fields_nbytes(item["fields"]) if bounded else 0,
            len(todo) + len(redeliver) + len(extra),
        )
        core.rows[row.key] = row
        core.nbytes += row.nbytes
        if row.group_id is not None:
            core.groups.setdefault(row.group_id, {})[row.key] = row
        for name in redeliver:
            ts = core.tasks[name]
            ts.retry[row.key] = None
            ts.returned[row.key] = item["deliveries"].get(name, 0)
            redeliveries += 1
        for name in (*todo, *extra):
            core.tasks[name].pending[row.key] = None
    core.version = state["version"]
    core.accepted = state["accepted"]
    core.running = 0 if reset_running else state["running"]
    core.next_lease_id = max(core.next_lease_id, state["next_lease_id"])
    core.retired = RetiredKeys(core.config.remember_retired, state["retired"])
    core.requeued = list(state["requeued"])
    counters = Counters(**state["counters"])
    counters.put_latency_s = core.counters.put_latency_s
    counters.get_latency_s = core.counters.get_latency_s
    counters.redeliveries += redeliveries
    core.counters = counters
    for name, tc in state["task_counters"].items():
        ts = core.tasks[name]
        ts.delivered, ts.acked, ts.staleness_hist = tc["delivered"], tc["acked"], dict(tc["staleness_hist"])
    core.notify()


def _check_fits(core: QueueCore, rows: list[dict[str, Any]]) -> None:
    """Refuse a snapshot this queue could never hold (before anything is replaced): more rows than ``max_rows``, or
    a row larger than ``max_bytes``.

    The total byte depth is not judged against ``max_bytes``: the rows were admitted once, and fields that stages
    added afterwards may take a live queue past its byte bound (``Capacity.max_bytes``), so a run's own snapshot can
    hold more bytes than the bound and must still restore under the same config. New rows then wait until the depth
    is back under, as they would have in the queue that was saved.
    """
    cap = core.config.capacity
    if cap.max_rows is not None and len(rows) > cap.max_rows:
        raise ConfigError(f"snapshot holds {len(rows)} rows, more than this queue's capacity.max_rows={cap.max_rows}")
    if cap.max_bytes is not None:
        for item in rows:
            nbytes = fields_nbytes(item["fields"])
            if nbytes > cap.max_bytes:
                raise ConfigError(
                    f"snapshot row {item['key']!r} is {nbytes} bytes, more than this queue's "
                    f"capacity.max_bytes={cap.max_bytes}"
                )


def atomic_write(path: str | os.PathLike[str], state: dict[str, Any]) -> None:
    """Pickle ``state`` to ``path`` atomically: a temp file in the same folder, fsync, rename."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a state dict written by :func:`atomic_write`."""
    with open(path, "rb") as f:
        state = pickle.load(f)
    if not isinstance(state, dict):
        raise ConfigError(f"{path}: not a relax_queue snapshot")
    return state


def snapshot_keys(path: str | os.PathLike[str]) -> list[Any]:
    """Keys of the rows a saved snapshot holds (not yet consumed by every task), in insertion order.

    Reads the file only; no queue is built, so it works whatever tasks the snapshot's queue registered.

    Raises:
        ConfigError: if ``path`` is not a relax_queue snapshot.
    """
    state = read_state(path)
    if state.get("format") != FORMAT:
        raise ConfigError(f"{path}: not a relax_queue snapshot (expected format {FORMAT!r})")
    return [row["key"] for row in state["rows"]]
