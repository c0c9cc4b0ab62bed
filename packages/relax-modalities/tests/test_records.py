"""Dataset records through the sample processor: inline bytes as content-named files, the record path equal to
the manifest path for the synthetic tasks (plain-string template), and the chats that template cannot render."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from PIL import Image

from relax_modalities import MediaError, SampleProcessor, build_stream
from relax_modalities._record import materialise_media
from relax_modalities._rows import MediaItem, RowSchema, parse_row
from relax_modalities.synthetic import read_manifest, write_synthetic_dataset
from relax_modalities.text import TinyTokenizer


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (30, 20), (10, 200, 30)).save(buf, "PNG")
    return buf.getvalue()


def test_inline_bytes_become_one_file_named_by_content(tmp_path: Path) -> None:
    data = _png()
    first = materialise_media(MediaItem("image", data=data), tmp_path)
    again = materialise_media(MediaItem("image", data=data), tmp_path)
    assert first == again and first.endswith(".png") and Path(first).read_bytes() == data
    assert len(list(tmp_path.iterdir())) == 1
    assert materialise_media(MediaItem("image", path="/x/y.png"), None) == "/x/y.png"
    with pytest.raises(MediaError, match="inline bytes need a folder"):
        materialise_media(MediaItem("image", data=data), None)


def test_record_path_equals_the_manifest_path_for_synthetic_tasks(tmp_path: Path) -> None:
    processor = SampleProcessor(TinyTokenizer())
    path = write_synthetic_dataset(tmp_path, ["image", "audio", "video", "text"], 2, seed=1)
    items = {it.id: it for it in read_manifest(tmp_path / "manifest.jsonl")}
    for record in build_stream([path], shuffle_buffer=0):
        via_record = processor.process_record(record)
        direct = processor(items[record.extra_info["id"]])
        assert via_record.keys() == direct.keys()
        assert all(torch.equal(via_record[k], direct[k]) for k in direct), record.uid


def test_plain_template_refuses_media_after_text(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(_png())
    row = {"prompt": [{"role": "user", "content": "1+<image>"}], "images": ["a.png"], "answer": "1"}
    record = parse_row(row, RowSchema(), tmp_path)
    with pytest.raises(ValueError, match="media before the text only"):
        SampleProcessor(TinyTokenizer()).process_record(record)
