"""CPU snapshots of a state dict for :class:`~relax_services.weights.stores.InProcessWeightStore`, written into the
buffers of a retired version when no tensor of the process still uses them.

A fresh allocation per version costs the first touch of every page (a page fault per 4 KiB, and the kernel zeroing
it): measured on SmolLM2-135M's 0.54 GB, copying into fresh buffers took ~5× a copy into buffers already
touched. Readers compute in place with the tensors they fetched (``load_state_dict(assign=True)``), so a retired
buffer may be written only when nothing references its storage any more: the test is the storage's use count
(every tensor, view, ``nn.Parameter`` or numpy array over the bytes holds one), never Python object identity.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from relax_services.weights.packed import view_identity

StateDict = dict[str, torch.Tensor]

_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)
"""``(storage._cdata) -> int``: references to a storage's bytes (c10's ``StorageImpl`` refcount). Private to torch,
so it is looked up once; without it no buffer is ever reused (each version is a fresh allocation, as before)."""


def _layout(
    state_dict: Mapping[str, torch.Tensor], by_object: bool
) -> list[tuple[str, tuple[int, ...], torch.dtype, str]]:
    """Per name: shape, dtype and the first name it shares its bytes with (by tensor object or by storage view)."""
    first: dict[object, str] = {}
    out = []
    for name, t in state_dict.items():
        key = id(t) if by_object else view_identity(t.detach())
        out.append((name, tuple(t.shape), t.dtype, first.setdefault(key, name)))
    return out


def snapshot(state_dict: Mapping[str, torch.Tensor], into: StateDict | None = None) -> StateDict:
    """Contiguous CPU copies of ``state_dict``'s tensors, each shared storage view copied once (tied names get one
    tensor object). ``into``: a previous snapshot of the same layout (see :func:`reusable`) to write into instead
    of allocating."""
    out: StateDict = {}
    made: dict[tuple[object, ...], torch.Tensor] = {}
    for name, tensor in state_dict.items():
        t = tensor.detach()
        ident = view_identity(t)
        if ident in made:
            out[name] = made[ident]
            continue
        dst = into[name] if into is not None else torch.empty(t.shape, dtype=t.dtype)
        dst.copy_(t)
        made[ident] = out[name] = dst
    return out


def views(snap: StateDict) -> StateDict:
    """New tensor objects over ``snap``'s bytes (tied names stay one object): what a reader is handed, so that
    everything it keeps counts in the storages' use counts (:func:`unreferenced`)."""
    made: dict[int, torch.Tensor] = {}
    return {name: made.setdefault(id(t), t.detach()) for name, t in snap.items()}


def unreferenced(snap: StateDict) -> bool:
    """Whether no tensor besides ``snap``'s own references any of its storages (then they may be overwritten)."""
    if _storage_use_count is None:
        return False
    for t in {id(t): t for t in snap.values()}.values():  # each its own allocation (snapshot)
        storage = t.untyped_storage()  # itself one reference while it lives, the tensor the other
        if int(_storage_use_count(storage._cdata)) != 2:
            return False
    return True


def reusable(spare: StateDict, state_dict: Mapping[str, torch.Tensor]) -> bool:
    """Whether ``spare`` (a snapshot) can take a snapshot of ``state_dict``: same names, shapes, dtypes and ties,
    and no reader references it."""
    return _layout(spare, by_object=True) == _layout(state_dict, by_object=False) and unreferenced(spare)
