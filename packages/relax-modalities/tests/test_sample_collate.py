"""process_sample / collate output runs through a real tiny Qwen2.5-Omni thinker."""

from typing import Any

import pytest
import torch

from relax_modalities import (
    ProcessorSettings,
    SampleProcessor,
    collate,
    cost_aware_batches,
    estimate_cost,
    pack_batch,
    process_sample,
)
from relax_modalities.synthetic import TaskItem
from relax_modalities.text import TINY_VOCAB, TinyTokenizer

V = TINY_VOCAB


def _count(ids: torch.Tensor, token: int) -> int:
    return int((ids == token).sum())


@pytest.mark.parametrize("task", ["image", "audio", "video", "text", "audio_video"])
def test_single_item_runs_through_the_thinker(task: str, synthetic_items: list[TaskItem], tiny_thinker: Any) -> None:
    item = next(it for it in synthetic_items if it.task == task)
    inputs = process_sample(item, TinyTokenizer())
    ids = inputs["input_ids"]
    assert ids.shape[0] == 1 and ids[0, 0] == V.bos_id and ids[0, -1] == V.assistant_id
    merge = tiny_thinker.config.vision_config.spatial_merge_size
    # Placeholder counts equal what the model's encoders will produce.
    if "image_grid_thw" in inputs:
        assert _count(ids, V.image_pad_id) == int(inputs["image_grid_thw"].prod(-1).sum()) // merge**2 == 4
        assert inputs["pixel_values"].shape[0] == int(inputs["image_grid_thw"].prod(-1).sum())
    if "video_grid_thw" in inputs:
        assert _count(ids, V.video_pad_id) == int(inputs["video_grid_thw"].prod(-1).sum()) // merge**2 == 8
        assert inputs["video_second_per_grid"].tolist() == [0.5]
    if "input_features" in inputs:
        lengths = inputs["feature_attention_mask"].sum(-1)
        _, out_lengths = tiny_thinker.audio_tower._get_feat_extract_output_lengths(lengths)
        assert _count(ids, V.audio_pad_id) == int(out_lengths.sum())
        assert inputs["input_features"].shape[:2] == (1, 128)
    with torch.no_grad():
        out = tiny_thinker(**inputs)
    assert out.logits.shape == (1, ids.shape[1], V.vocab_size)
    assert torch.isfinite(out.logits).all()


def test_packed_batch_matches_single_forwards(synthetic_items: list[TaskItem], tiny_thinker: Any) -> None:
    proc = SampleProcessor(TinyTokenizer(), ProcessorSettings())
    items = synthetic_items[:5]  # one of each task
    samples = [proc(it) for it in items]
    with torch.no_grad():
        singles = [tiny_thinker(**s).logits[0, -1] for s in samples]
        for side in ("left", "right"):
            batch = pack_batch(samples, padding_side=side)
            logits = tiny_thinker(**batch.inputs).logits  # [B, T_max, V]
            lengths = batch.inputs["attention_mask"].sum(-1)
            for i, single in enumerate(singles):
                last = -1 if side == "left" else int(lengths[i]) - 1
                torch.testing.assert_close(logits[i, last], single, atol=1e-4, rtol=1e-4)


def test_collate_packs_media_without_padding(synthetic_items: list[TaskItem]) -> None:
    tok = TinyTokenizer()
    samples = [process_sample(it, tok) for it in synthetic_items[:10]]
    batch = pack_batch(samples, padding_side="left")
    inputs = batch.inputs
    # Patch rows are exactly the sum of each media item's grid, nothing padded.
    assert inputs["pixel_values"].shape[0] == sum(
        int(s["image_grid_thw"].prod()) for s in samples if "pixel_values" in s
    )
    assert batch.image_offsets.tolist() == [0, 16, 32]
    assert batch.video_offsets.tolist() == [0, 32, 64, 96, 128]
    assert batch.image_owner.tolist() == [0, 5] and batch.video_owner.tolist() == [2, 4, 7, 9]
    assert batch.audio_owner.tolist() == [1, 4, 6, 9]
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    assert ids.shape == mask.shape and (ids[mask == 0] == V.pad_id).all()
    assert (mask[:, -1] == 1).all()  # left padding: every row ends with a real token
    for modality, tok_id in (("image", V.image_pad_id), ("video", V.video_pad_id), ("audio", V.audio_pad_id)):
        pos = batch.placeholder_positions[modality]
        assert len(pos) == _count(ids, tok_id) and (ids[pos[:, 0], pos[:, 1]] == tok_id).all()
    right = collate(samples, padding_side="right")
    assert (right["attention_mask"][:, 0] == 1).all()
    assert right["input_features"].shape[0] == 4 and right["feature_attention_mask"].shape[0] == 4


def test_cost_aware_batches() -> None:
    costs = [10, 100, 12, 95, 11, 50]
    # sorted: 10(0) 11(4) 12(2) 50(5) 95(3) 100(1); padded cost = size * max within 120;
    # batches come back ordered by their smallest item index.
    assert cost_aware_batches(costs, 120) == [[0, 4, 2], [1], [3], [5]]
    assert cost_aware_batches(costs, 1000, max_batch_size=2) == [[0, 4], [3, 1], [2, 5]]
    assert cost_aware_batches([500.0], 100) == [[0]]  # over budget alone: own batch
    with pytest.raises(ValueError, match="max_batch_cost"):
        cost_aware_batches(costs, 0)


def test_estimate_cost_counts_media(synthetic_items: list[TaskItem]) -> None:
    tok = TinyTokenizer()
    by_task = {it.task: process_sample(it, tok) for it in synthetic_items[:5]}
    text = by_task["text"]["input_ids"].shape[1]
    assert estimate_cost(by_task["text"]) == text
    image = by_task["image"]
    assert estimate_cost(image) == image["input_ids"].shape[1] + 16
    assert estimate_cost(by_task["audio"]) == by_task["audio"]["input_ids"].shape[1] + 50
