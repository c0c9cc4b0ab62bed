"""A state dict in the form the object store hands to readers without copying.

Ray writes a numpy array into its shared-memory object store with one copy and gives every reader on the node a
read-only view of those pages (pickle protocol 5 out-of-band buffers); a torch tensor instead goes through
pickle's bytes, one more copy on each side, and every reader process gets its own copy. So a version is published
as :class:`PackedWeights`: numpy views of the tensors' bytes (bfloat16, which numpy lacks, as its 16-bit pattern),
each shared storage once (tied embedding and LM head are one array, not two), and readers turn them back into
tensors that view the same pages. A reader on the CPU that computes in the published dtype then holds no copy of
its own: every rollout worker and evaluator of a node reads one copy of the weights
(:meth:`HFRolloutEngine.load_weights <relax_services.engines.hf.rollout.HFRolloutEngine.load_weights>`).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["PackedWeights", "memcpy_seconds", "pack_state", "unpack_state", "view_identity"]

_NUMPY_VIEW = {torch.bfloat16: torch.int16}
"""Dtypes numpy has no type for, and the same-width integer their bytes travel as."""


@dataclass(frozen=True)
class PackedWeights:
    """A state dict as numpy arrays.

    Attributes:
        arrays: One array per distinct storage, keyed by the first name that used it.
        dtypes: Torch dtype name of each array (``"bfloat16"`` arrays hold the 16-bit patterns as int16).
        aliases: ``{name: name of the array it shares}`` for tensors that shared a storage (tied weights).
    """

    arrays: dict[str, np.ndarray]
    dtypes: dict[str, str]
    aliases: dict[str, str]

    @property
    def num_bytes(self) -> int:
        """Bytes of array data (each shared storage once)."""
        return sum(a.nbytes for a in self.arrays.values())


def view_identity(t: torch.Tensor) -> tuple[object, ...]:
    """Tensors with equal identities view the same bytes (tied weights: embedding and LM head)."""
    return (t.device, t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape), t.stride(), t.dtype)


def pack_state(state_dict: Mapping[str, torch.Tensor]) -> PackedWeights:
    """Numpy views (no copy for contiguous CPU tensors) of ``state_dict``'s tensors; a tensor that views the same
    bytes as an earlier one (same storage, offset, shape and strides) becomes an alias of it.

    The arrays view the tensors' memory: pack, put and drop them before the tensors change.
    """
    arrays: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[object, ...], str] = {}
    for name, tensor in state_dict.items():
        t = tensor.detach()
        ident = view_identity(t)
        if t.device.type == "cpu" and ident in seen:
            aliases[name] = seen[ident]
            continue
        seen[ident] = name
        t = t.to("cpu").contiguous()
        arrays[name] = t.view(_NUMPY_VIEW.get(t.dtype, t.dtype)).numpy()
        dtypes[name] = str(t.dtype).removeprefix("torch.")
    return PackedWeights(arrays, dtypes, aliases)


def unpack_state(packed: PackedWeights) -> dict[str, torch.Tensor]:
    """Tensors viewing ``packed``'s arrays (no copy); aliases are the same tensor as the name they share.

    Arrays that came out of the object store are read-only: the tensors must never be written (inference reads
    them; :meth:`torch.nn.Module.load_state_dict` without ``assign`` copies out of them).
    """
    out: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():
        # torch warns that a read-only array gives a tensor it cannot protect; readers never write these.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
        for name, array in packed.arrays.items():
            dtype: torch.dtype = getattr(torch, packed.dtypes[name])
            tensor = torch.from_numpy(array)
            out[name] = tensor.view(dtype) if dtype in _NUMPY_VIEW else tensor
    for name, target in packed.aliases.items():
        out[name] = out[target]
    return out


def memcpy_seconds(num_bytes: int, probe_bytes: int = 64 * 2**20) -> float:
    """Seconds one plain copy of ``num_bytes`` bytes between two preallocated CPU buffers takes here: the yardstick
    a publication's time is printed against.

    Measured on ``min(num_bytes, probe_bytes)`` bytes and scaled linearly (a copy past the caches runs at memory
    bandwidth), so the yardstick never holds two copies of a model; best of three, so the first touch's page
    faults are not counted."""
    size = max(1, min(num_bytes, probe_bytes))
    src = torch.ones(size, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return best * num_bytes / size
