"""Weight sync as a stream of buckets: gather full tensors from the shards, pack them into buckets of a
bounded byte size, and apply them bucket by bucket on the rollout side.

A whole state dict never has to exist at once: the trainer holds one gathered tensor plus one bucket, the
rollout side one bucket. A bucket is packed into one flat byte buffer with a small index (name, dtype,
shape, offset of each tensor): the unit one ``torch.distributed.broadcast`` from trainer rank 0 sends on the
GPU path, and what :class:`InProcessWeightStream` hands over here.

A tensor larger than the bucket size is not split: it travels alone in a bucket of its own (an oversized
bucket). Splitting would let a bucket end inside a tensor, and the receiver would then have to hold partial
tensors across buckets; one tensor bigger than the budget is the rare case (embeddings of a large
vocabulary) and its size is known up front.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch.distributed.tensor import DTensor

__all__ = [
    "BucketLoader",
    "InProcessWeightStream",
    "PackedBucket",
    "SyncStats",
    "TensorSpec",
    "WeightStream",
    "bucket_tensors",
    "full_tensors",
    "log_sync",
    "pack_bucket",
    "stream_buckets",
    "unpack_bucket",
]

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 256 * 2**20
"""256 MiB, the bucket size the field uses for multi-billion-parameter models."""

ALIGNMENT = 16
"""Bytes each tensor's offset in a packed buffer is a multiple of (the widest element, complex128)."""


def full_tensors(model: torch.nn.Module, *, keep: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full CPU tensor)`` for every entry of ``model.state_dict()``, in order.

    A sharded entry (a DTensor) is gathered when it is reached (a collective: every rank of its mesh must
    iterate in step); the full tensor is a detached CPU copy, never a view of the live weights. ``keep=False``
    (the ranks that only take part in the gathers): the gathered tensor is dropped on its device and nothing is
    yielded, so those ranks never hold a full copy.
    """
    for name, value in model.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if keep:
            yield name, value.detach().to("cpu", copy=True)


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor lies in a packed bucket.

    Attributes:
        name: State-dict key.
        dtype: Element type.
        shape: Tensor shape.
        offset: First byte in the bucket's buffer.
        num_bytes: Bytes of its data.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    num_bytes: int


@dataclass(frozen=True)
class PackedBucket:
    """Tensors packed into one contiguous byte buffer.

    Attributes:
        index: Position of the bucket in its version's stream (0-based).
        buffer: ``[bytes]`` uint8: the tensors' data, each at an offset aligned to ``ALIGNMENT``.
        specs: The tensors in the buffer, in order.
    """

    index: int
    buffer: torch.Tensor
    specs: tuple[TensorSpec, ...]

    @property
    def num_bytes(self) -> int:
        """Bytes of tensor data in the bucket (the buffer adds alignment padding)."""
        return sum(spec.num_bytes for spec in self.specs)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def bucket_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Groups consecutive tensors into buckets of at most ``bucket_bytes`` bytes each, in order.

    A bucket closes when the next tensor would overflow it; a tensor larger than ``bucket_bytes`` forms a
    bucket alone. Lazy: at most one bucket and the tensor after it are held at a time.

    Raises:
        ValueError: If ``bucket_bytes`` is not positive.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in tensors:
        n = _nbytes(tensor)
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += n
    if bucket:
        yield bucket


def pack_bucket(index: int, tensors: list[tuple[str, torch.Tensor]]) -> PackedBucket:
    """Copies ``tensors`` into one flat uint8 buffer with their :class:`TensorSpec` s; each tensor starts at a
    multiple of ``ALIGNMENT`` bytes, so that it can be viewed in place as its own dtype."""
    specs = []
    offset = 0
    for name, t in tensors:
        offset = -(-offset // ALIGNMENT) * ALIGNMENT
        specs.append(TensorSpec(name, t.dtype, tuple(t.shape), offset, _nbytes(t)))
        offset += _nbytes(t)
    buffer = torch.zeros(offset, dtype=torch.uint8)
    for spec, (_, t) in zip(specs, tensors, strict=True):
        buffer[spec.offset : spec.offset + spec.num_bytes] = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return PackedBucket(index, buffer, tuple(specs))


def unpack_bucket(bucket: PackedBucket) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views into ``bucket.buffer``, in packing order (bit-exact copies of what was packed)."""
    for spec in bucket.specs:
        raw = bucket.buffer[spec.offset : spec.offset + spec.num_bytes]
        yield spec.name, raw.view(spec.dtype).reshape(spec.shape)


@dataclass(frozen=True)
class SyncStats:
    """One version's weight sync.

    Attributes:
        version: Policy version sent.
        num_bytes: Bytes of tensor data.
        num_buckets: Buckets sent.
        seconds: Wall time from the first gather to the last bucket applied.
    """

    version: int
    num_bytes: int
    num_buckets: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        """Achieved throughput in GB/s (10⁹ bytes)."""
        return self.num_bytes / max(self.seconds, 1e-12) / 1e9


class BucketLoader:
    """Applies buckets one at a time to a rollout-side model's weights, in place, and checks at the end that
    every weight arrived exactly once.

    Args:
        model: The rollout-side model (same architecture and state-dict keys as the trainer's).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._targets = model.state_dict(keep_vars=False)
        self._seen: set[str] = set()

    def begin(self) -> None:
        """Starts a new version."""
        self._seen = set()

    def apply(self, bucket: PackedBucket) -> None:
        """Copies the bucket's tensors into the model.

        Raises:
            KeyError: If a name is not a weight of the model, or arrived twice in this version.
            ValueError: If a shape differs from the model's.
        """
        with torch.no_grad():
            for name, tensor in unpack_bucket(bucket):
                target = self._targets.get(name)
                if target is None:
                    raise KeyError(f"bucket {bucket.index}: {name!r} is not a weight of {type(self.model).__name__}")
                if name in self._seen:
                    raise KeyError(f"bucket {bucket.index}: {name!r} arrived twice in one version")
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"bucket {bucket.index}: {name!r} has shape {tuple(tensor.shape)}, "
                        f"the model's is {tuple(target.shape)}"
                    )
                target.copy_(tensor)
                self._seen.add(name)

    def finish(self) -> None:
        """Ends a version.

        Raises:
            KeyError: If some weights of the model never arrived.
        """
        missing = sorted(set(self._targets) - self._seen)
        if missing:
            raise KeyError(f"weight sync ended without {len(missing)} weights, e.g. {missing[:3]}")


@runtime_checkable
class WeightStream(Protocol):
    """Sends one policy version as a stream of buckets from the trainer to the rollout side.

    The trainer side calls :meth:`send` on every trainer rank with the same (lazy) buckets: gathering them
    from the shards is collective. The in-process stream applies each bucket to a :class:`BucketLoader`;
    the GPU path implements the same method with one NCCL ``broadcast`` of each bucket's buffer from trainer
    rank 0 to the rollout ranks, which unpack it into their loaders.
    """

    def send(self, version: int, buckets: Iterable[PackedBucket]) -> SyncStats:
        """Delivers every bucket of ``version`` in order and returns what it cost."""
        ...


class InProcessWeightStream:
    """:class:`WeightStream` into loaders in this process (only the rank given as ``source`` delivers).

    Args:
        loaders: Receivers of every bucket (rollout-side models in this process).
        is_source: Whether this process delivers (trainer rank 0); the other ranks only take part in the
            gathers.
    """

    def __init__(self, loaders: Iterable[BucketLoader], is_source: bool = True) -> None:
        self.loaders = list(loaders)
        self.is_source = is_source

    def send(self, version: int, buckets: Iterable[PackedBucket]) -> SyncStats:
        """Loads every bucket of ``version`` into each loader in order (on the source side) and returns the bytes
        and seconds it took."""
        start = time.perf_counter()
        if self.is_source:
            for loader in self.loaders:
                loader.begin()
        num_bytes = num_buckets = 0
        for bucket in buckets:
            num_bytes += bucket.num_bytes
            num_buckets += 1
            if self.is_source:
                for loader in self.loaders:
                    loader.apply(bucket)
        if self.is_source:
            for loader in self.loaders:
                loader.finish()
        stats = SyncStats(version, num_bytes, num_buckets, time.perf_counter() - start)
        log_sync(stats)
        return stats


def log_sync(stats: SyncStats, how: str = "") -> None:
    """Logs one version's sync figures (every :class:`WeightStream` writes this line; ``how`` says by which path)."""
    logger.info(
        "weight sync v%d%s: %d bytes in %d buckets, %.4f s, %.3f GB/s",
        stats.version,
        how,
        stats.num_bytes,
        stats.num_buckets,
        stats.seconds,
        stats.gb_per_s,
    )


def stream_buckets(
    model: torch.nn.Module,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    tensors: Callable[[torch.nn.Module], Iterable[tuple[str, torch.Tensor]]] = full_tensors,
) -> Iterator[PackedBucket]:
    """The weights of ``model`` (sharded or not) as packed buckets of at most ``bucket_bytes`` (a larger tensor
    goes alone), gathered lazily: collective for a sharded model, so every rank iterates in step."""
    for index, bucket in enumerate(bucket_tensors(tensors(model), bucket_bytes)):
        yield pack_bucket(index, bucket)
