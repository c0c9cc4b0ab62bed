"""process_sample / collate output runs through a real tiny Qwen2.5-Omni thinker."""

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from relax_modalities import (
    MediaError,
    ProcessorSettings,
    SampleProcessor,
    VideoSettings,
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


def test_audio_in_video_chunks_by_hand() -> None:
    from relax_modalities._sample import audio_in_video_chunks

    # 6 temporal patches of 4 tokens, 1 s each -> time indices 0, 25, ..., 125; chunks of 50 indices.
    # 120 audio tokens -> indices 0..119 -> 50, 50, 20.
    assert audio_in_video_chunks((6, 4, 4), 1.0, 120, 2) == ((8, 50), (8, 50), (8, 20))
    # A short clip: everything in the first chunk; more audio than video chunks is allowed.
    assert audio_in_video_chunks((2, 4, 4), 0.5, 25, 2) == ((8, 25),)
    assert audio_in_video_chunks((2, 4, 4), 0.5, 75, 2) == ((8, 50), (0, 25))


def test_audio_in_video_layout_runs_through_the_thinker(tmp_path: Path, tiny_thinker: Any) -> None:
    import numpy as np

    from relax_modalities.synthetic import MediaRef, write_mp4

    # 4 s at 4 fps with a 4 s tone: several 2-second chunks of interleaved video and audio tokens.
    frames = np.zeros((16, 56, 56, 3), dtype=np.uint8)
    for k in range(16):
        frames[k, :28, k * 2 : k * 2 + 28] = 255
    tone = (0.5 * np.sin(2 * np.pi * 440 * np.arange(64000) / 16000)).astype(np.float32)
    path = tmp_path / "av.mp4"
    write_mp4(path, frames, fps=4, audio=tone)
    item = TaskItem("av", "audio_video", "move and pitch?", (MediaRef("video", str(path), audio_track=True),))
    settings = ProcessorSettings(video=VideoSettings(fps=4.0), use_audio_in_video=True)
    inputs = process_sample(item, TinyTokenizer(), settings)
    ids = inputs["input_ids"][0].tolist()
    start = ids.index(V.vision_start_id)
    assert ids[start + 1] == V.audio_start_id  # vision_start audio_start … audio_end vision_end
    pads = [t for t in ids if t in (V.video_pad_id, V.audio_pad_id)]
    runs = [(k, len(list(g))) for k, g in itertools.groupby(pads)]
    # 8 temporal patches 0.5 s apart -> 4 video tokens each at indices 0, 12, 25, …: 16 video tokens
    # per 2-second chunk; audio 25 tokens per second -> 50 per chunk.
    assert [n for k, n in runs if k == V.video_pad_id] == [16, 16]
    assert next(n for k, n in runs if k == V.audio_pad_id) == 50
    assert runs[0][0] == V.video_pad_id and runs[1][0] == V.audio_pad_id
    with torch.no_grad():
        out = tiny_thinker(**inputs, use_audio_in_video=True)
    assert torch.isfinite(out.logits).all()


def test_an_unexpected_error_on_one_file_is_a_media_error_naming_it(
    tmp_path: Path, synthetic_items: list[TaskItem], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Fault injection: whatever a decoder raises for one file (here a ZeroDivisionError from the image
    # step) reaches the caller as that file's MediaError, with the original as its cause.
    import relax_modalities._paths as sample_module  # the image path decodes and patchifies

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise ZeroDivisionError("division by zero")

    item = next(it for it in synthetic_items if it.task == "image")
    monkeypatch.setattr(sample_module, "preprocess_image", broken)
    with pytest.raises(MediaError, match="ZeroDivisionError: division by zero") as info:
        process_sample(item, TinyTokenizer())
    assert info.value.path == item.media[0].path and info.value.modality == "image"
    assert isinstance(info.value.__cause__, ZeroDivisionError)
