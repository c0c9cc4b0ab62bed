"""The modality registry: the chat builders, the sample processor and the packer reach the modalities through it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from relax_modalities import MODALITY_PATHS, MediaError, modality_path, pack_batch, process_sample
from relax_modalities.synthetic import TaskItem
from relax_modalities.text import TINY_VOCAB, ChatBuilder, ChatTemplate, MediaSlot, TinyTokenizer

V = TINY_VOCAB
TOY_ID = 64  # one id past the tiny vocabulary


class _ToyTokenizer:
    """The tiny tokenizer plus one special string, ``<|toy|>`` (id 64)."""

    vocab_size = TOY_ID + 1

    def __init__(self) -> None:
        self.inner = TinyTokenizer()

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for i, piece in enumerate(text.split("<|toy|>")):
            out += ([TOY_ID] if i else []) + (self.inner.encode(piece) if piece else [])
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join("<|toy|>" if i == TOY_ID else self.inner.decode([i], skip_special_tokens) for i in ids)


def test_the_registry_lists_the_built_in_paths_in_forward_kwarg_order() -> None:
    assert list(MODALITY_PATHS) == ["image", "video", "audio"]
    assert [k for p in MODALITY_PATHS.values() for k in p.keys] == [
        "pixel_values",
        "image_grid_thw",
        "pixel_values_videos",
        "video_grid_thw",
        "video_second_per_grid",
        "input_features",
        "feature_attention_mask",
    ]
    with pytest.raises(KeyError, match="unknown media modality 'smell' \\(item 3\\); registered: image, video, audio"):
        modality_path("smell", "item 3")


def test_extra_spans_render_a_registered_modality_with_the_plain_template() -> None:
    template = ChatTemplate(extra_spans=(("toy", "<|vision_start|>", "<|toy|>", "<|vision_end|>"),))
    prompt = ChatBuilder(_ToyTokenizer(), template).build("1", [MediaSlot("toy", 2), MediaSlot("image", 1)])
    one = V.first_char_id + 1  # "1"
    assert prompt.input_ids == [
        *(V.bos_id, V.user_id),
        *(V.vision_start_id, TOY_ID, TOY_ID, V.vision_end_id),
        *(V.vision_start_id, V.image_pad_id, V.vision_end_id),
        *(one, V.assistant_id),
    ]
    assert [(s.modality, s.start, s.length) for s in prompt.spans] == [("toy", 3, 2), ("image", 7, 1)]


def test_a_slot_of_a_modality_without_a_span_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="no span for modality 'toy'"):
        ChatBuilder(TinyTokenizer()).build("1", [MediaSlot("toy", 2)])
    with pytest.raises(ValueError, match="modality name"):
        MediaSlot("", 2)


def test_an_unregistered_modality_in_an_item_is_a_media_error(tmp_path: Path) -> None:
    item = TaskItem(id="x", task="t", prompt="1", media=())
    bad = {"id": "x", "prompt": "1", "media": [{"modality": "toy", "path": str(tmp_path / "a.npy")}]}
    with pytest.raises(MediaError, match="unknown media modality 'toy' in item 'x'"):
        process_sample(bad, TinyTokenizer())
    assert process_sample(item, TinyTokenizer())["input_ids"].shape == (1, 4)  # bos user "1" assistant


def test_packed_owners_and_offsets_are_by_modality_name() -> None:
    # Two prompts: the first with two images of 4 and 16 patches, the second with one of 4 and no audio.
    def image_prompt(ids: list[int], grids: list[list[int]]) -> dict[str, torch.Tensor]:
        grid = torch.tensor(grids)
        return {
            "input_ids": torch.tensor([ids]),
            "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
            "pixel_values": torch.zeros(int(grid.prod(-1).sum()), 8),
            "image_grid_thw": grid,
        }

    a = image_prompt([V.image_pad_id, V.image_pad_id, 20], [[1, 2, 2], [1, 4, 4]])
    b = image_prompt([V.image_pad_id, 21], [[1, 2, 2]])
    packed = pack_batch([a, b], padding_side="right")
    assert set(packed.owners) == {"image", "video", "audio"} and set(packed.offsets) == {"image", "video"}
    assert packed.image_owner.tolist() == [0, 0, 1] and packed.owners["audio"].tolist() == []
    assert packed.image_offsets.tolist() == [0, 4, 20, 24] and packed.video_offsets.tolist() == [0]
    assert packed.inputs["pixel_values"].shape == (24, 8) and "input_features" not in packed.inputs
    assert packed.placeholder_positions["image"].tolist() == [[0, 0], [0, 1], [1, 0]]
    custom = pack_batch([a, b], padding_side="right", placeholder_ids={"text_one": 20})
    assert list(custom.placeholder_positions) == ["text_one"] and custom.placeholder_positions["text_one"].tolist() == [
        [0, 2]
    ]
