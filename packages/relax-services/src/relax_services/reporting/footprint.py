"""Where an update's time goes and how much memory a run holds: the per-update split (compute, publish, wait)
read from a run's ``metrics.jsonl``, and the peak PSS of a process tree sampled while the run goes.

PSS (proportional set size) counts a page shared by several processes once in total, split between them, so the
sum over a process tree is the memory the tree really holds (an RSS sum counts every shared torch library once
per process).
"""

from __future__ import annotations

import itertools
import os
import statistics
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

__all__ = ["PeakMemory", "UpdateSplit", "format_footprint", "tree_pss", "tree_pss_by_process", "update_split"]


def tree_pss(pid: int | None = None) -> int:
    """Bytes of PSS of process ``pid`` (default: this one) and all its descendants; a process that ends while
    being read counts 0. Falls back to RSS where the kernel does not report PSS."""
    return sum(size for _, _, size in tree_pss_by_process(pid))


def tree_pss_by_process(pid: int | None = None) -> list[tuple[int, str, int]]:
    """``(pid, label, bytes of PSS)`` of process ``pid`` (default: this one) and each of its descendants (see
    :func:`tree_pss`); the root is labelled ``driver``, a Ray worker by its actor class (``RolloutService``,
    ``QueueActor``, ``IDLE`` for an idle worker), any other process by its script or executable name."""
    import psutil

    try:
        root = psutil.Process(pid if pid is not None else os.getpid())
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    out = []
    for proc in procs:
        try:
            info = proc.memory_full_info()
            label = "driver" if proc.pid == root.pid else _label(proc.cmdline(), proc.name())
            out.append((proc.pid, label, int(getattr(info, "pss", info.rss))))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def _label(cmdline: list[str], name: str) -> str:
    """A process's role: ``ray::<actor name>:<Class>.<method>`` or ``ray::<Class>`` gives the class; a Python
    process its script's file name; anything else its executable name."""
    first = cmdline[0] if cmdline else ""
    if first.startswith("ray::"):
        title = first.split()[0].removeprefix("ray::").rpartition(":")[2]
        return title.partition(".")[0] or name
    if "python" in os.path.basename(first) and len(cmdline) > 1:
        script = next((a for a in cmdline[1:] if a.endswith(".py")), None)
        if script is not None:
            return os.path.basename(script)
    return name


class PeakMemory:
    """Samples :func:`tree_pss` of a process tree on a daemon thread; use as a context manager.

    Args:
        pid: Root of the tree (default: this process).
        interval_s: Seconds between samples (a short peak between two samples is missed).

    Attributes:
        peak_bytes: The largest sample so far.
        peak_processes: The process labels of that sample (:func:`tree_pss_by_process`), each with the PSS bytes
            of its processes (largest first): the split of ``peak_bytes``.
        samples: Samples taken.
    """

    def __init__(self, pid: int | None = None, interval_s: float = 0.5) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.pid = pid
        self.interval_s = interval_s
        self.peak_bytes = 0
        self.peak_processes: dict[str, list[int]] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-memory", daemon=True)

    def sample(self) -> int:
        """Take one sample now; returns it."""
        processes = tree_pss_by_process(self.pid)
        value = sum(size for _, _, size in processes)
        if value > self.peak_bytes:
            self.peak_bytes = value
            split: dict[str, list[int]] = {}
            for _, label, size in processes:
                split.setdefault(label, []).append(size)
            self.peak_processes = {label: sorted(sizes, reverse=True) for label, sizes in split.items()}
        self.samples += 1
        return value

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def start(self) -> PeakMemory:
        """Start sampling (one sample is taken at once); returns self."""
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> int:
        """Stop sampling after one last sample; returns the peak in bytes."""
        self._stop.set()
        self._thread.join(timeout=10)
        self.sample()
        return self.peak_bytes

    def __enter__(self) -> PeakMemory:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


@dataclass(frozen=True)
class UpdateSplit:
    """Median seconds per policy update, split by what the trainer did.

    Attributes:
        updates: Updates the medians are over.
        compute_s: Building the batch, forward, backward and optimizer step.
        publish_s: Publishing the new weights (snapshot and store) after the update.
        wait_s: Waiting for the queue to hand over a complete batch (rollout, reward and hops upstream).
        queue_s: The update's queue calls besides the get: the batch's ack with the version publish, one call
            (a round trip to the queue actor in the distributed mode; 0 in runs that did not record them).
        interval_s: Median seconds between consecutive updates (None when the records carry no times).
        other_s: Median of each update's interval less its four parts: what the trainer loop spends outside them
            (the metric record, the loop and, in one process, the other roles holding the GIL); None as above.
        publish_memcpy_s: Median seconds a plain memory copy of the published bytes takes on the trainer's machine
            (``weight_sync_memcpy_s``), the yardstick of ``publish_s``; None when the records carry none.
    """

    updates: int
    compute_s: float
    publish_s: float
    wait_s: float
    queue_s: float = 0.0
    interval_s: float | None = None
    other_s: float | None = None
    publish_memcpy_s: float | None = None

    @property
    def total_s(self) -> float:
        """Seconds of one update: compute + publish + wait."""
        return self.compute_s + self.publish_s + self.wait_s


def update_split(metrics_path: Path) -> UpdateSplit | None:
    """The per-update split of a run from the ``train`` records of its ``metrics.jsonl`` (None: no update)."""
    from relax_services.reporting.metrics import read_metrics

    compute, publish, wait, queue, times, memcpy = [], [], [], [], [], []
    for record in read_metrics(metrics_path, "train"):
        compute.append(float(record["train_s"]))
        publish.append(float(record.get("weight_sync_s", 0.0)))
        if "weight_sync_memcpy_s" in record:
            memcpy.append(float(record["weight_sync_memcpy_s"]))
        wait.append(float(record["wait_s"]))
        queue.append(float(record.get("queue_s", 0.0)))
        if "time" in record:
            times.append(float(record["time"]))
    if not compute:
        return None
    interval = other = None
    if len(times) == len(compute) > 1:
        # An update's wait starts where the previous update's record was made, so its interval is that record's
        # time to this one's: the parts of update i (i ≥ 1) lie inside interval i.
        gaps = [b - a for a, b in itertools.pairwise(times)]
        parts = [compute[i] + publish[i] + wait[i] + queue[i] for i in range(1, len(times))]
        interval = statistics.median(gaps)
        other = statistics.median(g - p for g, p in zip(gaps, parts, strict=True))
    return UpdateSplit(
        len(compute),
        statistics.median(compute),
        statistics.median(publish),
        statistics.median(wait),
        statistics.median(queue),
        interval,
        other,
        statistics.median(memcpy) if memcpy else None,
    )


def format_footprint(
    split: UpdateSplit | None, peak_bytes: int | None, processes: Mapping[str, Sequence[float]] | None = None
) -> str:
    """Summary lines: the per-update split, the peak PSS of the process tree and, given ``processes``
    (:attr:`PeakMemory.peak_processes`), its split by process label, largest first (MB; ``label ×n`` with each
    process's share for a label several processes have)."""
    if split is None:
        lines = ["per update: no update was made"]
    else:
        busy = (split.compute_s + split.publish_s) / max(split.total_s, 1e-9)
        line = (
            f"per update (median of {split.updates}): compute {split.compute_s:.3f}s, publish {split.publish_s:.3f}s, "
            f"wait {split.wait_s:.3f}s, queue calls {split.queue_s:.3f}s"
        )
        if split.interval_s is not None and split.other_s is not None:
            line += f"; interval {split.interval_s:.3f}s, of it outside these {split.other_s:.3f}s"
        lines = [line + f" (trainer busy {busy:.0%})"]
        if split.publish_memcpy_s:
            lines.append(
                f"publish: {split.publish_s / split.publish_memcpy_s:.1f}x a plain memory copy of the same bytes "
                f"({split.publish_memcpy_s:.3f}s)"
            )
    if peak_bytes is not None:
        lines.append(f"peak memory of the process tree (PSS): {peak_bytes / 1e9:.2f} GB")
    if processes:
        parts = []
        for label, sizes in sorted(processes.items(), key=lambda kv: -sum(kv[1])):
            each = "+".join(f"{s / 1e6:.0f}" for s in sizes)
            parts.append(f"{label} {each}" if len(sizes) == 1 else f"{label} ×{len(sizes)} {each}")
        lines.append(f"  at that peak, per process (MB PSS): {', '.join(parts)}")
    return "\n".join(lines)
