"""The modality registry: the chat builders, the sample processor, the packer, the processor settings and the
dataset row schema reach the modalities through it."""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Mapping, Sequence
from pathlib import Path

import pydantic
import pytest
import torch
from PIL import Image

from relax_modalities import (
    MODALITY_PATHS,
    AudioSettings,
    ImageSettings,
    MediaError,
    ProcessorSettings,
    RowSchema,
    VideoSettings,
    media_columns,
    modality_path,
    modality_table,
    pack_batch,
    parse_row,
    process_sample,
)
from relax_modalities._media import MediaBundle, PackedMedia
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


# ---- settings and dataset columns: declared by each path, derived by ProcessorSettings and the row reader -------
@dataclasses.dataclass(frozen=True)
class _ToySettings:
    scale: float = 1.0


class _ToyPath:
    """A registered modality that only declares its settings and column (nothing here processes a file)."""

    name = "toy"
    keys = ("toy_values",)
    column = "toys"
    default_settings = _ToySettings()

    def process(self, ref: object, settings: ProcessorSettings, media: MediaBundle) -> None:
        raise NotImplementedError  # not reached: these tests read settings and rows only

    def model_inputs(self, items: Sequence[object]) -> dict[str, torch.Tensor]:
        return {}

    def pack(self, samples: Sequence[Mapping[str, torch.Tensor]]) -> PackedMedia:
        return PackedMedia({}, torch.zeros(0, dtype=torch.long))

    def cost(self, sample: Mapping[str, torch.Tensor]) -> float:
        return 0.0


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(MODALITY_PATHS, "toy", _ToyPath())


def test_processor_settings_hold_each_registered_paths_settings(tmp_path: Path) -> None:
    default = ProcessorSettings()
    assert default.image == ImageSettings() and default.audio == AudioSettings()
    assert default.of("video", VideoSettings) == VideoSettings() and [n for n, _ in default.modalities] == [
        "image",
        "video",
        "audio",
    ]
    assert ProcessorSettings(audio=AudioSettings()) == default  # the defaults given or not: equal settings
    small = ImageSettings(max_pixels=56 * 56)
    given = ProcessorSettings(image=small, use_audio_in_video=True)
    assert given.modalities[0] == ("image", small) and given.image.max_pixels == 3136 and given.use_audio_in_video
    fast = dataclasses.replace(given, video=VideoSettings(fps=4.0))  # the keyword form replace() passes through
    assert fast.video.fps == 4.0 and fast.image is small and fast.audio == AudioSettings()
    assert pickle.loads(pickle.dumps(fast)) == fast and hash(fast) == hash(pickle.loads(pickle.dumps(fast)))
    assert fast.with_modality("image", ImageSettings()).image == ImageSettings()
    with pytest.raises(TypeError, match=r"'smell' is not a registered modality \(registered: image, video, audio\)"):
        ProcessorSettings(smell=ImageSettings())
    with pytest.raises(TypeError, match=r"ProcessorSettings\(image=...\): expected ImageSettings, got VideoSettings"):
        ProcessorSettings(image=VideoSettings())
    with pytest.raises(TypeError, match=r"settings are ImageSettings, not AudioSettings"):
        given.of("image", AudioSettings)

    # The image path reads its entry: a 112×112 image is (112/14)² = 64 patches, 16 tokens after the 2×2 merge;
    # under a 56×56 pixel budget it is resized to 56×56: 16 patches, 4 tokens.
    Image.new("RGB", (112, 112), (200, 0, 0)).save(tmp_path / "a.png")
    item = {"prompt": "1", "media": [{"modality": "image", "path": str(tmp_path / "a.png")}]}
    assert process_sample(item, TinyTokenizer())["pixel_values"].shape[0] == 64
    assert process_sample(item, TinyTokenizer(), given)["pixel_values"].shape[0] == 16


def test_a_registered_modality_gets_its_own_settings_entry(toy: None) -> None:
    settings = ProcessorSettings(toy=_ToySettings(scale=3.0))
    assert settings.of("toy", _ToySettings).scale == 3.0 and [n for n, _ in settings.modalities][-1] == "toy"
    assert ProcessorSettings().of("toy", _ToySettings) == _ToySettings()  # the path's defaults
    with pytest.raises(TypeError, match=r"ProcessorSettings\(toy=...\): expected _ToySettings, got ImageSettings"):
        ProcessorSettings(toy=ImageSettings())


def test_media_columns_are_the_paths_own_unless_the_schema_names_one() -> None:
    assert media_columns(RowSchema()) == {"image": "images", "video": "videos", "audio": "audios"}
    assert media_columns(RowSchema(image_key="pics"))["image"] == "pics"  # the built-ins' own keys still work
    named = media_columns(RowSchema(media_keys={"audio": "clips", "video": "movies"}))
    assert named == {"image": "images", "video": "movies", "audio": "clips"}
    with pytest.raises(pydantic.ValidationError, match=r"image_key is 'a' but media_keys\.image is 'b'"):
        RowSchema(image_key="a", media_keys={"image": "b"})
    with pytest.raises(ValueError, match=r"schema.media_keys: \['smell'\] not registered modalities"):
        media_columns(RowSchema(media_keys={"smell": "s"}))
    with pytest.raises(ValueError, match="modality 'video' and modality 'image' both read column 'images'"):
        media_columns(RowSchema(media_keys={"video": "images"}))
    with pytest.raises(ValueError, match="modality 'image' and prompt_key both read column 'prompt'"):
        media_columns(RowSchema(image_key="prompt"))


def test_the_row_reader_reads_a_registered_modalitys_column_and_marker(toy: None, tmp_path: Path) -> None:
    for name in ("a.npy", "b.npy", "c.png"):
        (tmp_path / name).write_bytes(b"x")
    row = {
        "prompt": [{"role": "user", "content": "<toy>1<image>+<toy>"}],
        "toys": ["a.npy", {"path": "b.npy", "unit": "m"}],
        "images": ["c.png"],
        "answer": "2",
    }
    record = parse_row(row, RowSchema(), tmp_path)
    assert [(m.kind, Path(m.path or "").name) for m in record.media] == [
        ("toy", "a.npy"),
        ("image", "c.png"),
        ("toy", "b.npy"),
    ]
    assert record.media[2].meta == {"unit": "m"}
    assert [(p.type, p.index, p.text) for p in record.messages[0].parts] == [
        ("toy", 0, ""),
        ("text", -1, "1"),
        ("image", 0, ""),
        ("text", -1, "+"),
        ("toy", 1, ""),
    ]
    renamed = parse_row(
        {**{k: v for k, v in row.items() if k != "toys"}, "pts": row["toys"]},
        RowSchema(media_keys={"toy": "pts"}),
        tmp_path,
    )
    assert renamed.media == record.media
    with pytest.raises(ValueError, match=r"column 'prompt': 2 toy placeholder\(s\) but 3 toy item\(s\)"):
        parse_row({**row, "toys": ["a.npy", "a.npy", "b.npy"]}, RowSchema(), tmp_path)
    with pytest.raises(ValueError, match="message 0: more toy placeholders than toy items"):
        parse_row({**row, "toys": ["a.npy"]}, RowSchema(), tmp_path)


def test_the_docs_table_of_modalities_is_the_registrys(toy: None) -> None:
    page = (Path(__file__).resolve().parents[3] / "docs" / "modalities.md").read_text(encoding="utf-8")
    shown = page.split("<!-- modality-table -->\n")[1].split("\n<!-- /modality-table -->")[0]
    toy_row = "| `toy` | `toys` | `<toy>` | `_ToySettings` | `toy_values` |"
    assert modality_table() == shown + "\n" + toy_row  # the built-ins as docs/modalities.md shows them, then the toy
