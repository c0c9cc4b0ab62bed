"""Dataset files: verl-schema parquet, JSONL with video and audio, `datasets` folders, mixing, resume."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import relax_core as rc
import relax_modalities as rm


def png_bytes(colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(buf, format="PNG")
    return buf.getvalue()


def verl_row(i: int, images: list[dict[str, Any]] | None, prompt: str | None = None) -> dict[str, Any]:
    """A row as verl's geo3k preprocessing writes it."""
    return {
        "data_source": "hiyouga/geometry3k",
        "prompt": None
        if prompt is None and i < 0
        else [{"role": "user", "content": prompt or f"<image>Find x in {i}."}],
        "images": images,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(i)},
        "extra_info": {"split": "train", "index": i},
    }


def write_verl_parquet(
    path: Path, n: int, *, row_group: int = 64, bad: dict[int, dict[str, Any]] | None = None
) -> None:
    rows = [verl_row(i, [{"bytes": png_bytes((i % 256, 0, 0)), "path": None}]) for i in range(n)]
    for i, row in (bad or {}).items():
        rows[i] = row
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group)


def test_verl_parquet_with_images(tmp_path: Path) -> None:
    (tmp_path / "img").mkdir()
    Image.new("RGB", (8, 8), (0, 255, 0)).save(tmp_path / "img" / "green.png")
    rows = [
        verl_row(0, [{"bytes": png_bytes((255, 0, 0)), "path": "original.png"}]),
        verl_row(1, [{"bytes": None, "path": "img/green.png"}], prompt="Compare <image> and <image>."),
        verl_row(2, [{"bytes": None, "path": "img/missing.png"}]),  # missing media file
        verl_row(3, [{"bytes": png_bytes((1, 2, 3)), "path": None}], prompt="No marker here."),  # count mismatch
        verl_row(4, [{"bytes": png_bytes((4, 5, 6)), "path": None}]),
    ]
    rows[1]["images"].append({"bytes": None, "path": str(tmp_path / "img" / "green.png")})  # absolute path
    rows[4]["prompt"] = None  # missing prompt
    path = tmp_path / "geo.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=2)

    stream = rm.build_stream([path], shuffle_buffer=1)
    assert "ability" not in stream.sources[0].columns  # a column the schema never reads is not decoded
    records = list(stream)
    assert [r.row for r in records] == [0, 1]
    first, second = records
    assert first.data_source == "hiyouga/geometry3k" and first.ground_truth == "0"
    assert first.extra_info == {"split": "train", "index": 0}
    assert first.messages[0].role == "user" and first.messages[0].text == "<image>Find x in 0."
    assert first.messages[0].parts[0] == rm.ContentPart("image", index=0)
    (image,) = first.media
    assert image.path is None and Image.open(io.BytesIO(image.data or b"")).getpixel((0, 0)) == (255, 0, 0)
    assert [m.path for m in second.media] == [str(tmp_path / "img" / "green.png")] * 2
    assert [p.type for p in second.messages[0].parts] == ["text", "image", "text", "image", "text"]
    assert first.uid == f"{path}:0"
    request = first.reward_request("\\boxed{0}")
    assert request == rc.RewardRequest("\\boxed{0}", "0", "hiyouga/geometry3k", {"split": "train", "index": 0})
    cfg = rc.RewardRunnerConfig(routes={"hiyouga/geometry3k": rc.RewardSpec(fn="math_verify")})
    with rc.build_reward_runner(cfg) as runner:
        assert [o.score for o in runner.score([request, second.reward_request("\\boxed{2}")])] == [1.0, 0.0]

    assert stream.stats.total == 3 and stream.stats.by_source == {str(path): 3}
    reasons = {b.row: b.reason for b in stream.stats.recent}
    assert all(b.source == str(path) for b in stream.stats.recent)
    assert "img/missing.png" in reasons[2] and "does not exist" in reasons[2]
    assert reasons[3] == "column 'prompt': 0 image placeholder(s) but 1 image item(s)"
    assert reasons[4] == "column 'prompt': missing or null"


def test_jsonl_with_video_and_audio(tmp_path: Path) -> None:
    (tmp_path / "clip.mp4").write_bytes(b"not decoded here")
    (tmp_path / "tone.wav").write_bytes(b"RIFF")
    lines = [
        {  # markers in the text, media in the columns
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "<video><audio>What?"}],
            "videos": [{"video": "clip.mp4", "fps": 2.0}],
            "audios": ["tone.wav"],
            "answer": "left",
            "data_source": "av",
        },
        {  # typed content parts carrying their own files
            "prompt": [
                {
                    "role": "user",
                    "content": [
                        {"type": "audio", "audio": "tone.wav"},
                        {"type": "text", "text": "pitch?"},
                        {"type": "video", "path": "clip.mp4"},
                    ],
                }
            ],
            "reward_model": {"ground_truth": "high"},
        },
        "not json at all",
        {"prompt": 7, "answer": "x"},
        {"prompt": "<audio>hi", "audios": ["gone.wav"], "answer": "x"},
        {"prompt": "plain text prompt", "answer": 3, "data_source": 5},
    ]
    path = tmp_path / "av.jsonl"
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
    path.write_text(text.replace("\n", "\n\n", 1) + "\n")  # a blank line is not a row

    stream = rm.build_stream([path], shuffle_buffer=1, schema=rm.RowSchema(default_data_source="user"))
    records = list(stream)
    assert [r.row for r in records] == [0, 2]
    av, typed = records
    assert av.data_source == "av" and av.ground_truth == "left"
    assert av.messages[0].text == "Be brief." and av.messages[1].text == "<video><audio>What?"
    assert [(m.kind, m.path) for m in av.media] == [
        ("video", str(tmp_path / "clip.mp4")),
        ("audio", str(tmp_path / "tone.wav")),
    ]
    assert av.media[0].meta == {"fps": 2.0}
    assert typed.data_source == "user" and typed.ground_truth == "high"
    assert [m.kind for m in typed.media] == ["audio", "video"]
    assert [p.type for p in typed.messages[0].parts] == ["audio", "text", "video"]
    reasons = {b.row: b.reason for b in stream.stats.recent}
    assert sorted(reasons) == [3, 4, 5, 6]
    assert reasons[3].startswith("not valid JSON")
    assert "expected a non-empty list of chat messages, got int" in reasons[4]
    assert "gone.wav" in reasons[5]
    assert reasons[6] == "column 'data_source': expected a string, got int"


def test_datasets_folder_and_load_dataset(tmp_path: Path) -> None:
    import datasets

    rows = [verl_row(i, [{"bytes": png_bytes((0, 0, i)), "path": None}]) for i in range(5)]
    ds = datasets.Dataset.from_list(rows).cast_column("images", datasets.Sequence(datasets.Image()))
    ds.save_to_disk(str(tmp_path / "folder"))
    records = list(rm.build_stream([tmp_path / "folder"], shuffle_buffer=1))
    assert [r.ground_truth for r in records] == ["0", "1", "2", "3", "4"]
    assert Image.open(io.BytesIO(records[3].media[0].data or b"")).getpixel((0, 0)) == (0, 0, 3)

    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "splits"))
    with pytest.raises(rm.DataFileError, match=r"holds splits \['test', 'train'\]; name one with split="):
        rm.HFDatasetSource.from_disk(tmp_path / "splits")
    assert len(rm.HFDatasetSource.from_disk(tmp_path / "splits", split="test")) == 5

    write_verl_parquet(tmp_path / "f.parquet", 6)
    hf = rm.HFDatasetSource.from_files("parquet", tmp_path / "f.parquet", cache_dir=tmp_path / "cache")
    own = rm.ParquetSource(tmp_path / "f.parquet")
    assert len(hf) == len(own) == 6
    assert [row for _, row in hf.iter_rows(4)] == [row for _, row in own.iter_rows(4)]

    (tmp_path / "g.jsonl").write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": i}) for i in range(3)))
    via_hf = rm.DataStream([rm.HFDatasetSource.from_files("json", tmp_path / "g.jsonl", cache_dir=tmp_path / "cache")])
    assert sorted(r.ground_truth for r in via_hf) == [0, 1, 2]


def test_unusable_files_fail_at_open_naming_them(tmp_path: Path) -> None:
    with pytest.raises(rm.DataFileError, match=r"nope\.parquet.*does not exist"):
        rm.build_stream([tmp_path / "nope.parquet"])
    pq.write_table(pa.table({"question": ["q"], "answer": ["a"]}), tmp_path / "other.parquet")
    with pytest.raises(rm.DataFileError, match=r"other\.parquet.*has no column 'prompt'"):
        rm.build_stream([tmp_path / "other.parquet"])
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), empty)
    assert list(rm.build_stream([empty])) == []
    pq.write_table(pa.table({"prompt": ["q"]}), tmp_path / "nogt.parquet")
    with pytest.raises(rm.DataFileError, match=r"no column 'reward_model' or 'answer'"):
        rm.build_stream([tmp_path / "nogt.parquet"])
    assert len(list(rm.build_stream([tmp_path / "nogt.parquet"], rm.RowSchema(require_ground_truth=False)))) == 1
    renamed = rm.RowSchema(prompt_key="question", answer_key="answer")
    assert next(rm.build_stream([tmp_path / "other.parquet"], renamed)).messages[0].text == "q"
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(rm.DataFileError, match=r"unknown suffix '\.csv'"):
        rm.build_stream([tmp_path / "x.csv"])


def ledger(stream: rm.DataStream, n: int | None = None) -> list[tuple[str, int]]:
    out = []
    for record in stream:
        out.append((record.uid, record.epoch))
        if n is not None and len(out) == n:
            break
    return out


def make_stream(tmp_path: Path) -> rm.DataStream:
    bad = {17: verl_row(-1, [{"bytes": png_bytes((0, 0, 0)), "path": None}])}  # prompt null
    for name, n in (("a.parquet", 300), ("b.parquet", 130)):
        if not (tmp_path / name).exists():
            write_verl_parquet(tmp_path / name, n, row_group=64, bad=bad)
    lines = [json.dumps({"prompt": f"q{i}", "answer": i}) for i in range(90)]
    (tmp_path / "c.jsonl").write_text("\n".join(lines))
    files = [
        rm.DataFileSpec(path=str(tmp_path / n), weight=w)
        for n, w in (("a.parquet", 2.0), ("b.parquet", 1.0), ("c.jsonl", 1.0))
    ]
    return rm.build_stream(files, shuffle_buffer=37, seed=5, epochs=2)


def test_every_good_row_once_per_epoch_and_exact_resume(tmp_path: Path) -> None:
    full = ledger(make_stream(tmp_path))
    good = {f"{tmp_path / 'a.parquet'}:{i}" for i in range(300)} | {f"{tmp_path / 'b.parquet'}:{i}" for i in range(130)}
    good = (good - {f"{tmp_path / 'a.parquet'}:17", f"{tmp_path / 'b.parquet'}:17"}) | {
        f"{tmp_path / 'c.jsonl'}:{i}" for i in range(90)
    }
    for epoch in (0, 1):
        uids = [u for u, e in full if e == epoch]
        assert len(uids) == len(set(uids)) == len(good) and set(uids) == good
    for cut in (0, 1, 36, 250, 517, 900, len(full) - 1):
        first = make_stream(tmp_path)
        head = ledger(first, cut) if cut else []
        state = json.loads(json.dumps(first.state_dict()))
        resumed = make_stream(tmp_path)
        resumed.load_state_dict(state)
        assert head + ledger(resumed) == full, f"resume after {cut} rows"
        assert resumed.stats.total == 2  # the bad row of each parquet, counted once (first pass only)


def test_state_of_other_sources_is_refused(tmp_path: Path) -> None:
    state = make_stream(tmp_path).state_dict()
    write_verl_parquet(tmp_path / "z.parquet", 3)
    with pytest.raises(ValueError, match="stream state is over sources"):
        rm.build_stream([tmp_path / "z.parquet"]).load_state_dict(state)


def test_shuffle_buffer_bounds_displacement(tmp_path: Path) -> None:
    write_verl_parquet(tmp_path / "s.parquet", 400, row_group=50)
    in_order = [r.row for r in rm.build_stream([tmp_path / "s.parquet"], shuffle_buffer=1)]
    assert in_order == list(range(400))
    buffer = 16
    rows = [r.row for r in rm.build_stream([tmp_path / "s.parquet"], shuffle_buffer=buffer, seed=1)]
    assert sorted(rows) == in_order and rows != in_order
    # Output step t draws from the rows read so far, which are rows 0 .. t + buffer - 1.
    assert all(row <= step + buffer - 1 for step, row in enumerate(rows))
    other_seed = [r.row for r in rm.build_stream([tmp_path / "s.parquet"], shuffle_buffer=buffer, seed=2)]
    assert other_seed != rows


def test_passes_do_not_overlap_so_a_whole_file_buffer_permutes_each_pass(tmp_path: Path) -> None:
    # Two 10-row files behind a buffer larger than both, endless: each file's rows come in blocks of 10 that are
    # each a permutation (the next pass is read only once this pass's rows are handed out). Read across passes
    # instead, a row of pass k + 1 could come before a row of pass k, and a block would repeat some rows.
    for name in ("x", "y"):
        rows = [json.dumps({"prompt": name, "answer": i}) for i in range(10)]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(rows))
    files = [tmp_path / "x.jsonl", tmp_path / "y.jsonl"]
    stream = rm.build_stream(files, shuffle_buffer=1024, seed=4, epochs=None)
    records = [next(stream) for _ in range(400)]
    for name in ("x", "y"):
        mine = [r for r in records if r.source.endswith(f"{name}.jsonl")]
        blocks = [mine[k : k + 10] for k in range(0, len(mine) - 9, 10)]
        assert len(blocks) >= 15
        for n, block in enumerate(blocks):
            assert sorted(r.row for r in block) == list(range(10)) and {r.epoch for r in block} == {n}
        assert len({tuple(r.row for r in block) for block in blocks}) > 1  # shuffled anew each pass


def test_mixing_weights_set_the_share_of_each_file(tmp_path: Path) -> None:
    (tmp_path / "x.jsonl").write_text("\n".join(json.dumps({"prompt": "x", "answer": i}) for i in range(10)))
    (tmp_path / "y.jsonl").write_text("\n".join(json.dumps({"prompt": "y", "answer": i}) for i in range(10)))
    files = [
        rm.DataFileSpec(path=str(tmp_path / "x.jsonl"), weight=3.0),
        rm.DataFileSpec(path=str(tmp_path / "y.jsonl"), weight=1.0),
    ]
    stream = rm.build_stream(files, shuffle_buffer=1, epochs=None)
    n = 4000
    share = sum(next(stream).source.endswith("x.jsonl") for _ in range(n)) / n
    # Binomial(4000, 0.75): standard deviation 0.0068; 0.03 is over 4 of them.
    assert abs(share - 0.75) < 0.03
    with pytest.raises(ValueError, match="every dataset file or to none"):
        rm.build_stream([files[0], tmp_path / "y.jsonl"])


def test_synthetic_tasks_as_a_dataset_file(tmp_path: Path) -> None:
    from relax_modalities.synthetic import read_manifest, write_synthetic_dataset

    path = write_synthetic_dataset(tmp_path, n_per_task=2, seed=3)
    items = {item.id: item for item in read_manifest(tmp_path / "manifest.jsonl")}
    stream = rm.build_stream([path], shuffle_buffer=1)
    records = list(stream)
    assert stream.stats.total == 0 and len(records) == len(items) == 10
    for record in records:
        item = items[record.extra_info["id"]]
        assert record.data_source == f"synthetic/{item.task}" and record.ground_truth == item.answer
        assert [(m.kind, m.path) for m in record.media] == [(m.modality, m.path) for m in item.media]
        assert [m.meta.get("audio_track", False) for m in record.media] == [m.audio_track for m in item.media]
        (message,) = record.messages
        assert message.text == "".join(f"<{m.modality}>" for m in item.media) + item.prompt


def _two_files(tmp_path: Path) -> list[rc.DataFileSpec]:
    for name in ("x", "y"):
        rows = [json.dumps({"prompt": name, "answer": i}) for i in range(50)]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(rows))
    return [rc.DataFileSpec(path=str(tmp_path / f"{n}.jsonl"), weight=1.0) for n in ("x", "y")]


def test_changed_weights_act_on_the_very_next_row(tmp_path: Path) -> None:
    # Each file has its own shuffle buffer and the file is drawn when a row is handed out, so rows of x already
    # buffered do not keep coming after x's weight drops: with x at 1e-6 of y, the chance that any of the next
    # 200 rows is x's is about 2e-4.
    stream = rm.build_stream(_two_files(tmp_path), shuffle_buffer=40, seed=3, epochs=None)
    first = [next(stream).source for _ in range(30)]
    assert {Path(s).name for s in first} == {"x.jsonl", "y.jsonl"}
    stream.set_weights([1e-6, 1.0])
    assert all(next(stream).source.endswith("y.jsonl") for _ in range(200))
    with pytest.raises(ValueError, match="2 positive numbers"):
        stream.set_weights([1.0, 0.0])


def test_resume_after_a_weight_change_is_exact(tmp_path: Path) -> None:
    files = _two_files(tmp_path)

    def run(stream: rm.DataStream, n: int) -> list[tuple[str, int]]:
        return [(r.uid, r.epoch) for r, _ in zip(stream, range(n), strict=False)]

    full_stream = rm.build_stream(files, shuffle_buffer=10, seed=9, epochs=None)
    head = run(full_stream, 37)
    full_stream.set_weights([3.0, 1.0])
    full = head + run(full_stream, 200)

    first = rm.build_stream(files, shuffle_buffer=10, seed=9, epochs=None)
    assert run(first, 37) == head
    first.set_weights([3.0, 1.0])
    state = json.loads(json.dumps(first.state_dict()))
    resumed = rm.build_stream(files, shuffle_buffer=10, seed=9, epochs=None)  # weights come from the state
    resumed.load_state_dict(state)
    assert resumed.weights == [3.0, 1.0]
    assert head + run(resumed, 200) == full
