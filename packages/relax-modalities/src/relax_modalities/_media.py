"""Containers the modality paths fill: one prompt's processed media, and one modality's part of a batch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from relax_modalities.text import MediaSlot

__all__ = ["MediaBundle", "PackedMedia"]


@dataclass
class MediaBundle:
    """One prompt's processed media, in prompt order: each modality's items and the chat slots they fill.

    Attributes:
        slots: the placeholder slots in the order the chat renders them (a video with its sound track may add
            an audio slot, or interleave the two in one video slot).
        items: modality name → that modality's processed items (whatever its `ModalityPath.process` appends),
            in prompt order.
    """

    slots: list[MediaSlot] = field(default_factory=list)
    items: dict[str, list[Any]] = field(default_factory=dict)

    def add(self, modality: str, item: object) -> None:
        """Appends one processed item of ``modality`` (its slot is added separately, with `slots`)."""
        self.items.setdefault(modality, []).append(item)


@dataclass(frozen=True)
class PackedMedia:
    """One modality's part of a packed batch.

    Attributes:
        inputs: its forward kwargs for the whole batch (empty when no prompt has the modality).
        owner: ``[n_items]`` int64 index of the prompt each item belongs to, in item order.
        offsets: ``[n_items + 1]`` row offsets of each item along the packed axis, for modalities packed along
            one (patches); ``None`` for modalities that are stacked instead.
    """

    inputs: dict[str, torch.Tensor]
    owner: torch.Tensor
    offsets: torch.Tensor | None = None
