"""Publishing a policy version through Ray's object store: a state dict of torch tensors (what relax published
before) beside :class:`~relax_services.weights.packed.PackedWeights` (numpy buffers readers map), for a model of
SmolLM2-135M's shapes. Per path: the publisher's put, a reader's fetch, and the memory of reader processes that
each load the version into a model of their own (PSS: a page shared by k processes counts 1/k in each)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from relax_services.weights.packed import PackedWeights, memcpy_seconds, pack_state, unpack_state
from relax_services.weights.stores import cpu_copy, state_dict_bytes

if TYPE_CHECKING:
    import torch
    from ray import ObjectRef
    from transformers import LlamaConfig

__all__ = ["PublishRow", "format_rows", "measure_publish", "smollm2_config"]


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
