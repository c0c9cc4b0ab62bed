"""Omni-modal collation: text padded, media packed along the patch axis, and cost-aware batching."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from relax_modalities._sample import pad_audio_features
from relax_modalities.text import TINY_VOCAB, TinyVocab

PaddingSide = Literal["left", "right"]


@dataclass
class PackedBatch:
    """Several prompts packed for one thinker forward.

    Attributes:
        inputs: the thinker's forward kwargs: ``input_ids``/``attention_mask`` ``[B, T_max]``
            (padded on one side), media concatenated along the patch axis with their grids, audio
            clips ``[n_aud, 128, L_max]`` with ``feature_attention_mask``.
        image_offsets: ``[n_img + 1]`` row offsets of each image in ``pixel_values``.
        video_offsets: ``[n_vid + 1]`` row offsets of each video in ``pixel_values_videos``.
        image_owner: ``[n_img]`` index of the prompt each image belongs to (likewise video/audio).
        video_owner: ``[n_vid]``.
        audio_owner: ``[n_aud]``.
        placeholder_positions: modality → ``[K, 2]`` (row, column) of every placeholder token.
    """

    inputs: dict[str, torch.Tensor]
    image_offsets: torch.Tensor
    video_offsets: torch.Tensor
    image_owner: torch.Tensor
    video_owner: torch.Tensor
    audio_owner: torch.Tensor
    placeholder_positions: dict[str, torch.Tensor] = field(default_factory=dict)


def _offsets(grids: list[torch.Tensor]) -> torch.Tensor:
    sizes = torch.tensor([int(g.prod()) for g in grids], dtype=torch.long)
    return torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])


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
) -> PackedBatch:
    """Pack per-prompt kwargs (from `process_sample`) into one batch without padding media.

    Args:
        samples: per-prompt dicts as `process_sample` returns them.
        pad_id: id filling the padded text positions (masked out by ``attention_mask``).
        padding_side: ``"left"`` for generation, ``"right"`` for training.
        vocab: gives the placeholder ids for ``placeholder_positions``.

    Raises:
        ValueError: for an empty batch or an unknown padding side.
    """
    if not samples:
        raise ValueError("pack_batch needs at least one sample")
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    ids, mask = _pad_text(samples, pad_id, padding_side)
    inputs: dict[str, torch.Tensor] = {"input_ids": ids, "attention_mask": mask}
    owners: dict[str, list[int]] = {"image": [], "video": [], "audio": []}
    img_grids: list[torch.Tensor] = []
    vid_grids: list[torch.Tensor] = []
    for i, s in enumerate(samples):
        if "image_grid_thw" in s:
            img_grids += list(s["image_grid_thw"])
            owners["image"] += [i] * len(s["image_grid_thw"])
        if "video_grid_thw" in s:
            vid_grids += list(s["video_grid_thw"])
            owners["video"] += [i] * len(s["video_grid_thw"])
        if "input_features" in s:
            owners["audio"] += [i] * len(s["input_features"])
    if img_grids:
        inputs["pixel_values"] = torch.cat([s["pixel_values"] for s in samples if "pixel_values" in s])
        inputs["image_grid_thw"] = torch.stack(img_grids)
    if vid_grids:
        inputs["pixel_values_videos"] = torch.cat([s["pixel_values_videos"] for s in samples if "video_grid_thw" in s])
        inputs["video_grid_thw"] = torch.stack(vid_grids)
        inputs["video_second_per_grid"] = torch.cat(
            [s["video_second_per_grid"] for s in samples if "video_grid_thw" in s]
        )
    if owners["audio"]:
        clips: list[torch.Tensor] = []
        for s in samples:
            if "input_features" in s:
                lengths = s["feature_attention_mask"].sum(-1).tolist()
                clips += [f[:, : int(n)] for f, n in zip(s["input_features"], lengths, strict=True)]
        inputs["input_features"], inputs["feature_attention_mask"] = pad_audio_features(clips)
    pad_ids = {"image": vocab.image_pad_id, "video": vocab.video_pad_id, "audio": vocab.audio_pad_id}
    positions = {m: torch.nonzero((ids == t) & (mask == 1)) for m, t in pad_ids.items()}
    return PackedBatch(
        inputs=inputs,
        image_offsets=_offsets(img_grids),
        video_offsets=_offsets(vid_grids),
        image_owner=torch.tensor(owners["image"], dtype=torch.long),
        video_owner=torch.tensor(owners["video"], dtype=torch.long),
        audio_owner=torch.tensor(owners["audio"], dtype=torch.long),
        placeholder_positions=positions,
    )


def collate(
    samples: Sequence[Mapping[str, torch.Tensor]],
    *,
    pad_id: int = TINY_VOCAB.pad_id,
    padding_side: PaddingSide = "left",
) -> dict[str, torch.Tensor]:
    """The thinker kwargs of several prompts (`pack_batch` without the bookkeeping)."""
    return pack_batch(samples, pad_id=pad_id, padding_side=padding_side).inputs


def estimate_cost(sample: Mapping[str, torch.Tensor]) -> float:
    """Rough compute cost of one prompt: LLM tokens + vision-encoder patches + audio-encoder frames.

    Vision patches and audio frames (after the first stride-2 conv) are the sequence lengths the
    encoders attend over, so they are counted one-for-one with text tokens.
    """
    cost = float(sample["input_ids"].shape[-1])
    for key in ("pixel_values", "pixel_values_videos"):
        if key in sample:
            cost += sample[key].shape[0]
    if "feature_attention_mask" in sample:
        cost += float(sample["feature_attention_mask"].sum()) / 2
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
