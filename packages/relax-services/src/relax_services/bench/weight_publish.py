"""Publishing policy versions of a model of SmolLM2-135M's shapes, against a plain memory copy of the same bytes.

- :func:`measure_versions`: every version's publish seconds through each store a run uses, side by side — the
  in-process store (colocated mode) allocating every version afresh and recycling a retired version's buffers, and
  the Ray store (distributed mode) — with the heap trimmed before each publication as the engines trim it after an
  update, and a reader holding the newest version as a rollout engine does.
- :func:`measure_publish`: through Ray's object store, a state dict of torch tensors (what relax published before)
  beside :class:`~relax_services.weights.packed.PackedWeights` (numpy buffers readers map): the publisher's put, a
  reader's fetch, and the memory of reader processes that each load the version into a model of their own (PSS: a
  page shared by k processes counts 1/k in each)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from relax_services.weights.packed import PackedWeights, memcpy_seconds, pack_state, unpack_state
from relax_services.weights.stores import InProcessWeightStore, RayWeightStore, WeightStore, cpu_copy, state_dict_bytes

if TYPE_CHECKING:
    import torch
    from ray import ObjectRef
    from transformers import LlamaConfig

__all__ = [
    "PublishRow",
    "VersionSeries",
    "format_rows",
    "format_versions",
    "measure_publish",
    "measure_versions",
    "smollm2_config",
]


def smollm2_config(layers: int = 30) -> LlamaConfig:
    """A Llama config with SmolLM2-135M's shapes (hidden 576, MLP 1536, 9 heads of which 3 key/value heads,
    vocabulary 49,152, tied embedding), ``layers`` decoder layers."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
    )


@dataclass(frozen=True)
class PublishRow:
    """One publication path, medians over the repeats.

    Attributes:
        path: ``"torch state dict"`` or ``"packed (numpy buffers)"``.
        num_bytes: Bytes published (each shared storage once for the packed path).
        put_s: Publisher's seconds from the state dict to the object in the store.
        fetch_s: A reader's seconds from the object to tensors it can load.
        reader_pss: Bytes of PSS of each reader process once it computes with the version.
    """

    path: str
    num_bytes: int
    put_s: float
    fetch_s: float
    reader_pss: list[int]


class _Reader:
    """A reader process: a model of the same shapes that loads a version the way a rollout engine does."""

    def __init__(self, config: LlamaConfig) -> None:
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM(config).eval()  # type: ignore[no-untyped-call]

    def load(self, boxed: list[ObjectRef[object]], packed: bool) -> float:
        """Fetch the version and load it (packed: compute with the fetched tensors; else copy into the model)."""
        import ray

        start = time.perf_counter()
        value = ray.get(boxed[0])
        state = unpack_state(cast(PackedWeights, value)) if packed else cast("dict[str, torch.Tensor]", value)
        seconds = time.perf_counter() - start
        self.model.load_state_dict(state, strict=False, assign=packed)
        return seconds

    def pss(self) -> int:
        """This process's PSS bytes."""
        import gc

        from relax_services.reporting.footprint import tree_pss

        gc.collect()
        return tree_pss()


def measure_publish(readers: int = 2, repeats: int = 3, layers: int = 30) -> tuple[float, list[PublishRow]]:
    """Both paths on one model of SmolLM2-135M's shapes, in a running Ray session.

    Returns:
        ``(seconds of a plain memory copy of the fp32 weights, one row per path)``.
    """
    import ray
    from transformers import LlamaForCausalLM

    config = smollm2_config(layers)
    state = LlamaForCausalLM(config).state_dict()  # type: ignore[no-untyped-call]
    memcpy = memcpy_seconds(pack_state(state).num_bytes)
    reader_cls: Any = ray.remote(num_cpus=0)(_Reader)  # ray's stubs do not type an actor class's methods
    rows = []
    for path, packed in (("torch state dict", False), ("packed (numpy buffers)", True)):
        procs = [reader_cls.remote(config) for _ in range(readers)]
        puts, fetches, ref = [], [], None
        for _ in range(repeats):
            ref = None  # the previous version goes, as the store's newest-only rule drops it
            start = time.perf_counter()
            ref = ray.put(pack_state(state) if packed else cpu_copy(state))
            puts.append(time.perf_counter() - start)
            fetches.extend(ray.get([p.load.remote([ref], packed) for p in procs]))
        num_bytes = pack_state(state).num_bytes if packed else state_dict_bytes(cpu_copy(state))
        pss = ray.get([p.pss.remote() for p in procs])
        rows.append(PublishRow(path, num_bytes, statistics.median(puts), statistics.median(fetches), pss))
        for p in procs:
            ray.kill(p)
        del ref
    return memcpy, rows


def format_rows(memcpy_s: float, rows: list[PublishRow]) -> str:
    """The side-by-side table (MB = 1e6 B)."""
    lines = [
        f"plain memory copy of the weights: {memcpy_s:.3f}s",
        "path | MB | put s (x copy) | fetch s | reader PSS MB",
    ]
    for r in rows:
        lines.append(
            f"{r.path} | {r.num_bytes / 1e6:.0f} | {r.put_s:.3f} ({r.put_s / memcpy_s:.1f}x) | {r.fetch_s:.4f} | "
            + " + ".join(f"{b / 1e6:.0f}" for b in r.reader_pss)
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class VersionSeries:
    """One store's publications of successive versions.

    Attributes:
        store: What published (``"in-process, fresh"``, ``"in-process, recycled"``, ``"ray"``).
        seconds: Publish seconds of each version, in order.
        memcpy_s: Seconds of a plain memory copy of the same bytes between two buffers touched beforehand, timed
            just before each publication (the machine's load moves both).
        cpu_seconds: CPU seconds of this process during each publication (the wall time of a loaded machine
            includes waiting for a core; the CPU time counts the copy and its page faults only).
        memcpy_cpu_s: CPU seconds of the plain copy, beside each publication's.
        resident: Bytes resident in this process after the last version, once a reader moved to it (the
            in-process store's versions and spare; for Ray the object store's pages this process touched).
    """

    store: str
    seconds: list[float]
    memcpy_s: list[float]
    cpu_seconds: list[float]
    memcpy_cpu_s: list[float]
    resident: int

    @property
    def ratios(self) -> list[float]:
        """Each publication's seconds over its plain copy's."""
        return [s / m for s, m in zip(self.seconds, self.memcpy_s, strict=True)]

    @property
    def cpu_ratios(self) -> list[float]:
        """Each publication's CPU seconds over its plain copy's."""
        return [s / m for s, m in zip(self.cpu_seconds, self.memcpy_cpu_s, strict=True)]


def _resident_bytes() -> int:
    """This process's resident set (``VmRSS``), bytes."""
    import re
    from pathlib import Path

    found = re.search(r"^VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    return int(found.group(1)) * 1024 if found else 0


class _PlainCopy:
    """The yardstick: one copy of ``num_bytes`` bytes between two buffers allocated and touched beforehand, timed
    beside each publication (wall and CPU seconds), so that the other load of the machine weighs on both alike."""

    def __init__(self, num_bytes: int) -> None:
        import torch

        self.src = torch.ones(num_bytes, dtype=torch.uint8)
        self.dst = torch.zeros_like(self.src)

    def __call__(self) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        self.dst.copy_(self.src)
        return time.perf_counter() - wall, time.process_time() - cpu


def _series(name: str, store: WeightStore, state: dict[str, torch.Tensor], versions: int) -> VersionSeries:
    from relax_services._malloc import release_free_memory

    plain_copy = _PlainCopy(pack_state(state).num_bytes)
    seconds, memcpy, cpu, memcpy_cpu, held = [], [], [], [], None
    for version in range(1, versions + 1):
        release_free_memory()  # the engines hand free heap pages back after each update (relax_services._malloc)
        copy_wall, copy_cpu = plain_copy()
        memcpy.append(copy_wall)
        memcpy_cpu.append(copy_cpu)
        start = time.process_time()
        seconds.append(store.publish(version, state).seconds)
        cpu.append(time.process_time() - start)
        held = store.fetch(None)  # a reader moves to the newest and computes with it until the next
    del plain_copy
    release_free_memory()
    resident = _resident_bytes()
    del held
    return VersionSeries(name, seconds, memcpy, cpu, memcpy_cpu, resident)


def measure_versions(versions: int = 20, layers: int = 30, ray_store: bool = True) -> list[VersionSeries]:
    """Publishes ``versions`` versions through each store, one store after the other (the previous one dropped),
    in this process (with ``ray_store``, in a running Ray session)."""
    from transformers import LlamaForCausalLM

    state = LlamaForCausalLM(smollm2_config(layers)).state_dict()  # type: ignore[no-untyped-call]
    series = [
        _series("in-process, fresh", InProcessWeightStore(keep=1, recycle=False), state, versions),
        _series("in-process, recycled", InProcessWeightStore(keep=1), state, versions),
    ]
    if ray_store:
        series.append(_series("ray", RayWeightStore.create("relax-bench-weight-versions", keep=1), state, versions))
    return series


def format_versions(series: list[VersionSeries]) -> str:
    """Per version, each store's publish seconds beside the plain copy's and their ratio, wall and CPU; then medians
    of the first three versions and of the rest, and each store's resident memory (MB = 1e6 B)."""
    lines = ["version | " + " | ".join(f"{s.store}: publish s / copy s (x), CPU x" for s in series)]
    for i in range(max(len(s.seconds) for s in series)):
        cells = [
            f"{s.seconds[i]:.3f} / {s.memcpy_s[i]:.3f} ({s.ratios[i]:.1f}x), {s.cpu_ratios[i]:.1f}x"
            if i < len(s.seconds)
            else ""
            for s in series
        ]
        lines.append(f"{i + 1} | " + " | ".join(cells))
    for s in series:
        parts = []
        for label, ratios in (("wall", s.ratios), ("CPU", s.cpu_ratios)):
            first, rest = ratios[:3], ratios[3:] or ratios
            parts.append(
                f"{label} versions 1-3 median {statistics.median(first):.1f}x, later median "
                f"{statistics.median(rest):.1f}x (max {max(rest):.1f}x)"
            )
        lines.append(f"{s.store}: " + "; ".join(parts) + f"; resident after the last {s.resident / 1e6:.0f} MB")
    return "\n".join(lines)
