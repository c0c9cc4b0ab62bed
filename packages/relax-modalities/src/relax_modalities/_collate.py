"""Omni-modal collation: text padded, media packed along the patch axis, and cost-aware batching."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from relax_modalities._modality import MODALITY_PATHS
from relax_modalities.text import TINY_VOCAB, TinyVocab

PaddingSide = Literal["left", "right"]


@dataclass
class PackedBatch:
    """Several prompts packed for one thinker forward.

    Attributes:
        inputs: the thinker's forward kwargs: ``input_ids``/``attention_mask`` ``[B, T_max]``
            (padded on one side), then each modality's (`ModalityPath.pack`): media concatenated along the
            patch axis with their grids, audio clips ``[n_aud, 128, L_max]`` with ``feature_attention_mask``.
        owners: modality → ``[n_items]`` index of the prompt each item belongs to (every registered modality).
        offsets: modality → ``[n_items + 1]`` row offsets of each item along its packed axis (image and video:
            ``pixel_values`` / ``pixel_values_videos``).
        placeholder_positions: modality → ``[K, 2]`` (row, column) of every placeholder token.
    """

    inputs: dict[str, torch.Tensor]
    owners: dict[str, torch.Tensor] = field(default_factory=dict)
    offsets: dict[str, torch.Tensor] = field(default_factory=dict)
    placeholder_positions: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def image_offsets(self) -> torch.Tensor:
        """``[n_img + 1]`` row offsets of each image in ``pixel_values``."""
        return self.offsets["image"]

    @property
    def video_offsets(self) -> torch.Tensor:
        """``[n_vid + 1]`` row offsets of each video in ``pixel_values_videos``."""
        return self.offsets["video"]

    @property
    def image_owner(self) -> torch.Tensor:
        """``[n_img]`` index of the prompt each image belongs to."""
        return self.owners["image"]

    @property
    def video_owner(self) -> torch.Tensor:
        """``[n_vid]``."""
        return self.owners["video"]

    @property
    def audio_owner(self) -> torch.Tensor:
        """``[n_aud]``."""
        return self.owners["audio"]


def _pad_text(
    samples: Sequence[Mapping[str, torch.Tensor]], pad_id: int, side: PaddingSide
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [s["input_ids"].reshape(-1) for s in samples]
    longest = max(len(r) for r in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)  # [B, T_max]
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(longest - len(r), longest) if side == "left" else slice(0, len(r))
        ids[i, sl] = r
        mask[i, sl] = 1
    return ids, mask


def pack_batch(
    samples: Sequence[Mapping[str, torch.Tensor]],
    *,
    pad_id: int = TINY_VOCAB.pad_id,
    padding_side: PaddingSide = "left",
    vocab: TinyVocab = TINY_VOCAB,
    placeholder_ids: Mapping[str, int] | None = None,
) -> PackedBatch:
    """Pack per-prompt kwargs (from `process_sample`) into one batch without padding media.

    Args:
        samples: per-prompt dicts as `process_sample` returns them.
        pad_id: id filling the padded text positions (masked out by ``attention_mask``).
        padding_side: ``"left"`` for generation, ``"right"`` for training.
        vocab: gives the placeholder ids for ``placeholder_positions`` (image, video, audio).
        placeholder_ids: modality → placeholder id, in place of ``vocab``'s (a checkpoint's ids, or a
            registered modality's).

    Raises:
        ValueError: for an empty batch or an unknown padding side.
    """
    if not samples:
        raise ValueError("pack_batch needs at least one sample")
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    ids, mask = _pad_text(samples, pad_id, padding_side)
    out = PackedBatch(inputs={"input_ids": ids, "attention_mask": mask})
    for name, path in MODALITY_PATHS.items():
        part = path.pack(samples)
        out.inputs.update(part.inputs)
        out.owners[name] = part.owner
        if part.offsets is not None:
            out.offsets[name] = part.offsets
    pad_ids = dict(
        placeholder_ids
        if placeholder_ids is not None
        else {"image": vocab.image_pad_id, "video": vocab.video_pad_id, "audio": vocab.audio_pad_id}
    )
    out.placeholder_positions = {m: torch.nonzero((ids == t) & (mask == 1)) for m, t in pad_ids.items()}
    return out


def collate(
    samples: Sequence[Mapping[str, torch.Tensor]],
    *,
    pad_id: int = TINY_VOCAB.pad_id,
    padding_side: PaddingSide = "left",
) -> dict[str, torch.Tensor]:
    """The thinker kwargs of several prompts (`pack_batch` without the bookkeeping)."""
    return pack_batch(samples, pad_id=pad_id, padding_side=padding_side).inputs


def estimate_cost(sample: Mapping[str, torch.Tensor]) -> float:
    """Rough compute cost of one prompt: LLM tokens + each modality's `ModalityPath.cost` (vision-encoder
    patches + audio-encoder frames for the built-in ones).

    Vision patches and audio frames (after the first stride-2 conv) are the sequence lengths the
    encoders attend over, so they are counted one-for-one with text tokens.
    """
    cost = float(sample["input_ids"].shape[-1])
    for path in MODALITY_PATHS.values():
        cost += path.cost(sample)
    return cost


def cost_aware_batches(
    costs: Sequence[float], max_batch_cost: float, *, max_batch_size: int | None = None
) -> list[list[int]]:
    """Group item indices into batches of similar cost, each within ``max_batch_cost``.

    Items are sorted by cost (stable, so equal costs keep their order) and cut greedily so that
    ``len(batch) * max(cost in batch)``, the padded cost, stays within the budget; an item costlier
    than the budget alone gets a batch of its own. Batches are returned in the order of their first
    item, so a shuffled input stays shuffled at the batch level.

    Args:
        costs: cost of each item (e.g. from `estimate_cost`).
        max_batch_cost: budget of one batch's padded cost.
        max_batch_size: optional cap on items per batch.
    """
    if max_batch_cost <= 0:
        raise ValueError(f"max_batch_cost must be > 0, got {max_batch_cost}")
    order = sorted(range(len(costs)), key=lambda i: costs[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        # Sorted ascending, so costs[i] is the batch's maximum once added.
        full = max_batch_size is not None and len(current) >= max_batch_size
        if current and (full or (len(current) + 1) * costs[i] > max_batch_cost):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    batches.sort(key=min)
    return batches
