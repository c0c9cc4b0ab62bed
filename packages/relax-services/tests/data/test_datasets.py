"""Dataset files and user rewards in the run (no Ray): config forms, the start-up check, records rendered with
the checkpoint's chat template, inline media, the synthetic tasks through the dataset path, reward requests."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from relax_core import ConfigError, build_reward_runner
from relax_modalities import DataFileError, build_stream
from relax_modalities.synthetic import read_manifest, write_synthetic_dataset
from relax_services.cli import main
from relax_services.config import load_run_config
from relax_services.data.files import RecordStream, check_data, record_item
from relax_services.data.run_data import PromptBuilder, data_report, prepare_data
from relax_services.rows import reward_request


def _png(colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (28, 28), colour).save(buf, "PNG")
    return buf.getvalue()


def _write(folder: Path, n: int = 6, *, bad: bool = False) -> Path:
    """A verl-schema parquet: even rows name an image file beside the parquet, odd rows carry its bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        colour = (200, 10 * i, 0)
        if i % 2 == 0:
            (folder / f"im{i}.png").write_bytes(_png(colour))
            image = {"bytes": None, "path": f"im{i}.png"}
        else:
            image = {"bytes": _png(colour), "path": None}
        rows.append(
            {
                "data_source": "geo/colour",
                "prompt": [{"role": "user", "content": "<image>which colour? r b"}],
                "images": [image],
                "reward_model": {"style": "rule", "ground_truth": "r"},
                "extra_info": {"index": i},
            }
        )
    if bad:
        rows.append({**rows[0], "images": [{"bytes": None, "path": "missing.png"}], "extra_info": {"index": n}})
    path = folder / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_train_files_take_paths_lists_and_specs() -> None:
    one = load_run_config(None, ["data.train_files=a.parquet"])
    many = load_run_config(None, ["data.train_files=[a.parquet,b.jsonl]", "data.schema.prompt_key=question"])
    spec = load_run_config({"data": {"train_files": [{"path": "a.parquet", "weight": 2.0}]}})
    assert [f.path for f in one.data.train_files] == ["a.parquet"]
    assert [f.path for f in many.data.train_files] == ["a.parquet", "b.jsonl"]
    assert many.data.schema_.prompt_key == "question"
    assert spec.data.train_files[0].weight == 2.0
    with pytest.raises(ConfigError, match=r"data\.schema\.no_such_key"):
        load_run_config(None, ["data.schema.no_such_key=x"])


def test_reward_config_keeps_name_and_takes_a_user_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    default = load_run_config(None, []).reward.runner_config()
    assert default.default.fn == "exact_match"  # the default run's reward is unchanged
    (tmp_path / "rw.py").write_text("def score(response, ground_truth, metadata):\n    return 0.25\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_run_config(None, ["reward.fn=rw.py:score", "reward.timeout_s=5", "reward.fallback_score=-1"])
    assert cfg.reward.fn == f"{tmp_path / 'rw.py'}:score"  # absolute: the services run in other folders
    with build_reward_runner(cfg.reward.runner_config()) as runner:
        assert [o.score for o in runner.score([reward_request("x", {"task": "t", "answer": "a"})])] == [0.25]


def test_reward_request_reads_record_fields_or_the_synthetic_answer() -> None:
    synthetic = reward_request("r", {"task": "image", "answer": "b"})
    assert (synthetic.ground_truth, synthetic.data_source, dict(synthetic.metadata)) == ("b", "image", {})
    info = {"task": "x", "answer": "[1, 2]", "data_source": "d", "ground_truth": [1, 2], "extra_info": {"k": 1}}
    request = reward_request("r", info)
    assert (request.ground_truth, request.data_source, dict(request.metadata)) == ([1, 2], "d", {"k": 1})


def test_check_data_names_a_missing_file_a_missing_column_and_a_missing_reward(tmp_path: Path) -> None:
    missing = tmp_path / "nope.parquet"
    with pytest.raises(DataFileError, match=r"nope\.parquet.*does not exist \(data\.train_files\)"):
        check_data(load_run_config(None, [f"data.train_files={missing}"]))
    no_prompt = tmp_path / "cols.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "q", "answer": "a"}]), no_prompt)
    with pytest.raises(DataFileError, match=r"cols\.parquet.*has no column 'prompt'"):
        check_data(load_run_config(None, [f"data.train_files={no_prompt}"]))
    good = _write(tmp_path / "good")
    with pytest.raises(ValueError, match=r"reward: .*nothere\.py"):
        check_data(load_run_config(None, [f"data.train_files={good}", f"reward.fn={tmp_path / 'nothere.py'}:f"]))
    with pytest.raises(DataFileError, match=r"data\.eval_files"):
        check_data(load_run_config(None, [f"data.train_files={good}", f"data.eval_files={missing}"]))
    check_data(load_run_config(None, [f"data.train_files={good}"]))  # a good file passes


def test_check_data_names_a_schema_media_key_of_no_registered_modality(tmp_path: Path) -> None:
    good = _write(tmp_path / "good")
    with pytest.raises(ValueError, match=r"data\.schema\.media_keys: \['smell'\] not registered modalities"):
        check_data(load_run_config(None, [f"data.train_files={good}", "data.schema.media_keys.smell=odours"]))
    renamed = load_run_config(None, [f"data.train_files={good}", "data.schema.media_keys.audio=clips"])
    assert renamed.data.schema_.media_key("audio") == "clips"
    check_data(renamed)  # a registered modality's column may be renamed


def test_relax_train_stops_on_a_file_without_the_prompt_column_before_a_run_folder(tmp_path: Path, capsys) -> None:
    table = tmp_path / "cols.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "q", "answer": "a"}]), table)
    code = main(["train", f"data.train_files={table}", f"run.output_dir={tmp_path / 'runs'}"])
    err = capsys.readouterr().err
    assert code == 2
    assert "cols.parquet" in err and "has no column 'prompt'" in err and "(data.train_files)" in err, err
    assert not (tmp_path / "runs").exists()


def test_parquet_records_become_prompts_and_inline_bytes_equal_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path / "d", bad=True)
    cfg = load_run_config(None, [f"data.train_files={path}", f"data.eval_files={path}", "data.shuffle_buffer=0"])
    data = prepare_data(cfg, tmp_path / "run")
    stream = data.stream
    assert isinstance(stream, RecordStream)
    items = [stream.next() for _ in range(7)]  # 6 good rows, then the second pass begins
    assert [i["id"] for i in items] == [f"{path}:{r}@0" for r in range(6)] + [f"{path}:0@1"]
    assert items[1]["ground_truth"] == "r" and items[1]["extra_info"] == {"index": 1}
    assert data_report(data)["recent_bad_rows"][-1][:2] == [str(path), 6]  # the missing image, named
    # Row 1's image is inline bytes, written to one file in the run folder; decoding it gives the same pixels as
    # the same PNG given as a path.
    inline = data.to_prompt(items[1])
    (tmp_path / "same.png").write_bytes(_png((200, 10, 0)))
    as_file = build_stream([_relinked(tmp_path, path)], shuffle_buffer=0)
    same = data.to_prompt(record_item(next(as_file)))
    assert torch.equal(inline.pixel_values, same.pixel_values)
    assert torch.equal(inline.input_ids, same.input_ids)
    # one file per distinct inline image (rows 1, 3, 5, read by the held-out set), none for the path rows
    assert len(list((tmp_path / "run" / "data" / "inline").iterdir())) == 3
    # Held-out: one entry per good row, grouped under its data_source, chance unknown.
    assert [task for task, _, _ in data.heldout] == ["geo/colour"] * 6
    assert math.isnan(data.chance["geo/colour"])


def _relinked(tmp_path: Path, path: Path) -> Path:
    """A one-row parquet whose image is ``same.png`` by path (row 1's bytes, as a file)."""
    row = pq.read_table(path).to_pylist()[1]
    row["images"] = [{"bytes": None, "path": "same.png"}]
    out = tmp_path / "one.parquet"
    pq.write_table(pa.Table.from_pylist([row]), out)
    return out


def test_chat_with_a_system_turn_and_media_mid_text_keeps_the_rows_order(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(_png((0, 0, 255)))
    row = {
        "prompt": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "look <image> now"},
        ],
        "images": ["a.png"],
        "answer": "b",
    }
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist([row]), path)
    cfg = load_run_config(None, [f"data.train_files={path}"])
    builder = PromptBuilder(cfg.model)
    prompt = builder(record_item(next(build_stream([path]))))
    tokenizer = builder._ready()[1].tokenizer
    n = int(prompt.image_grid_thw.prod()) // 4  # tokens of the image: its patches over the 2 × 2 merge
    expected = (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nlook "
        f"<|vision_bos|>{'<|IMAGE|>' * n}<|vision_eos|> now<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.decode(prompt.input_ids.tolist()) == expected


def test_synthetic_tasks_give_the_same_prompts_through_the_dataset_path(tmp_path: Path) -> None:
    cfg = load_run_config(None, [])
    builder = PromptBuilder(cfg.model)
    path = write_synthetic_dataset(tmp_path, ["image", "audio", "video", "text", "audio_video"], 2, seed=0)
    items = {it.id: it for it in read_manifest(tmp_path / "manifest.jsonl")}
    n = 0
    for record in build_stream([path], shuffle_buffer=0):
        via_file = builder(record_item(record)).__dict__
        direct = builder(items[record.extra_info["id"]]).__dict__
        assert via_file.keys() == direct.keys(), record.uid
        for key, value in direct.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(via_file[key], value), (record.uid, key)
            else:
                assert via_file[key] == value, (record.uid, key)
        n += 1
    assert n == 10


REWARDS = """
import time

def score(response, ground_truth, metadata):
    if metadata["index"] == 1:
        raise KeyError("no such field")
    if metadata["index"] == 2:
        time.sleep(30)  # past reward.timeout_s: the runner gives up on it
    return 1.0 if response == ground_truth else 0.25
"""


def test_reward_service_scores_from_meta_and_counts_errors_and_timeouts(tmp_path: Path) -> None:
    from relax_queue import QueueConfig, RowInput, TaskSpec, TransferQueue
    from relax_services.models.policy import checkpoint_of
    from relax_services.services.reward import RewardService

    (tmp_path / "rw.py").write_text(REWARDS)
    cfg = load_run_config(
        None, [f"reward.fn={tmp_path / 'rw.py'}:score", "reward.timeout_s=0.5", "reward.fallback_score=-1"]
    )
    tokenizer = checkpoint_of(cfg.model).tokenizer
    queue = TransferQueue(QueueConfig(tasks=(TaskSpec("reward"), TaskSpec("trainer"))))
    rows = []
    for i, text in enumerate(["r", "r", "r", "b"]):
        meta = {"task": "geo", "answer": "r", "prompt_key": f"p{i}", "data_source": "geo", "ground_truth": "r"}
        meta["extra_info"] = {"index": i}
        response = tokenizer.encode(text, add_special_tokens=False)
        rows.append(RowInput(f"p{i}/0", {"response": response, "meta": meta}))
    queue.put_many(rows)
    service = RewardService("reward-0", cfg, queue)
    service.step()
    got = {str(r.key): r.fields for r in queue.get("trainer", n=4, timeout=0).rows}
    assert [got[f"p{i}/0"]["reward"] for i in range(4)] == [1.0, -1.0, -1.0, 0.25]
    assert got["p1/0"]["reward_error"].startswith("KeyError") and got["p2/0"]["reward_error"].startswith("Timeout")
    (record,) = service.report()
    assert (record["scored"], record["failed"], record["timeouts"]) == (4, 2, 1)
    assert service.stop()  # closes the runner too


def test_undecodable_media_is_skipped_and_counted_as_a_bad_row_with_file_and_row(tmp_path: Path) -> None:
    from relax_queue import QueueConfig, TaskSpec, TransferQueue
    from relax_services.data.feeder import PromptFeeder

    path = _write(tmp_path / "d", n=4)
    table = pq.read_table(path).to_pylist()
    table[1]["images"] = [{"bytes": b"\x89PNG not really", "path": None}]  # parses, fails to decode
    pq.write_table(pa.Table.from_pylist(table), path)
    cfg = load_run_config(None, [f"data.train_files={path}", "data.shuffle_buffer=0"])
    data = prepare_data(cfg, tmp_path / "run")
    queue = TransferQueue(QueueConfig(tasks=(TaskSpec("rollout"),)))
    feeder = PromptFeeder(data.stream, data.to_prompt, queue, queue, 1, adaptive=False)
    stream = data.stream
    prompts = [feeder._process(stream.next()) for _ in range(4)]
    assert [p is None for p in prompts] == [False, True, False, False]
    report = data_report(data)
    assert report is not None and report["bad_rows"] == 1
    source, row, reason = report["recent_bad_rows"][0]
    assert (source, row) == (str(path), 1) and reason.startswith("image: ")
    assert feeder.skipped_items == {f"{path}:1@0"}


# The distributed run's prompt path: the feeder puts record rows (no prompt built in the driver), a Rollout worker
# builds the prompts, and a row whose media cannot be read is skipped and counted exactly as when the feeder built
# the prompts itself: same skipped item, same bad-row report, the key taken out of the ledger (as if never
# generated), and the group's admission given back.


def _bad_row_files(tmp_path: Path) -> Path:
    path = _write(tmp_path / "d", n=4)
    table = pq.read_table(path).to_pylist()
    table[1]["images"] = [{"bytes": b"\x89PNG not really", "path": None}]  # parses, fails to decode
    pq.write_table(pa.Table.from_pylist(table), path)
    return path


def test_a_rollout_worker_skips_a_bad_row_and_the_feeder_counts_it_as_its_own(tmp_path: Path) -> None:
    from relax_queue import QueueConfig, TaskSpec, TransferQueue
    from relax_services.control.pipeline import queue_configs
    from relax_services.data.feeder import PromptFeeder
    from relax_services.services import RolloutService
    from relax_services.weights import InProcessWeightStore

    path = _bad_row_files(tmp_path)
    overrides = [f"data.train_files={path}", "data.shuffle_buffer=0", "trainer.groups_per_step=4"]
    cfg = load_run_config(None, [*overrides, "algorithm.group_size=2", "rollout.groups_per_call=4"])
    # The reference: the feeder builds the prompts itself and skips the bad row (test_datasets checks it).
    reference = prepare_data(cfg, tmp_path / "ref")
    queue = TransferQueue(QueueConfig(tasks=(TaskSpec("rollout"),)))
    feeder = PromptFeeder(reference.stream, reference.to_prompt, queue, queue, 1, adaptive=False)
    built = [feeder._process(reference.stream.next()) for _ in range(4)]
    assert [p is None for p in built] == [False, True, False, False]

    data = prepare_data(cfg, tmp_path / "run", build_heldout=False)
    prompts, samples = (TransferQueue(c) for c in queue_configs(cfg))
    records = PromptFeeder(data.stream, None, prompts, samples, cfg.algorithm.group_size, adaptive=False)
    weights = InProcessWeightStore()
    assert records.pump(max_groups=4) == 4  # four record rows: the bad one is not recognised here
    assert sorted(records.ledger.generated) == ["p0000000", "p0000001", "p0000002", "p0000003"]
    admitted = samples.metrics()["admission"]
    rollout = RolloutService("rollout-0", cfg, prompts, samples, weights, to_prompt=data.to_prompt)
    rollout.step()
    report = rollout.report()
    skipped = [r for r in report if r["kind"] == "skipped"]
    assert [(r["prompt_key"], r["reason"].split(":")[0]) for r in skipped] == [("p0000001", "image")]
    # Three groups of two samples came out; the bad row's two admissions were given back.
    assert samples.metrics()["depth_rows"] == 3 * 2
    assert samples.metrics()["admission"]["released"] == admitted["released"] + cfg.algorithm.group_size
    for record in skipped:  # what the controller does with the record
        records.mark_skipped(record["prompt_key"], record["reason"])
    assert records.skipped_items == feeder.skipped_items == {f"{path}:1@0"}
    assert records.skipped == feeder.skipped
    assert sorted(records.ledger.generated) == ["p0000000", "p0000002", "p0000003"]
    ours, theirs = data_report(data), data_report(reference)
    assert ours["bad_rows"] == theirs["bad_rows"] == 1
    assert ours["recent_bad_rows"] == theirs["recent_bad_rows"]
    records.mark_skipped("p0000001", skipped[0]["reason"])  # a restored snapshot delivers the row again
    assert data_report(data)["bad_rows"] == 1 and records.skipped == feeder.skipped


def test_the_evaluator_s_held_out_report_gives_the_driver_s_figures(tmp_path: Path) -> None:
    from relax_services.data.run_data import finish_heldout

    path = _write(tmp_path / "d", bad=True)
    cfg = load_run_config(None, [f"data.train_files={path}", f"data.eval_files={path}", "data.shuffle_buffer=0"])
    here = prepare_data(cfg, tmp_path / "here")  # built in this process: the reference
    there = prepare_data(cfg, tmp_path / "there", build_heldout=False)
    assert there.chance == {} and there.report.heldout_by_source == {}
    prompts, found = there.heldout.build()  # what the Evaluator does in its process
    assert [task for task, _, _ in prompts] == [task for task, _, _ in here.heldout]
    finish_heldout(there, found)
    finish_heldout(there, found)  # a restarted Evaluator reports again: nothing counted twice
    assert there.report.heldout_by_source == here.report.heldout_by_source == {"geo/colour": 6}
    assert data_report(there) == data_report(here)
    assert there.skipped_heldout == here.skipped_heldout
    assert there.chance.keys() == here.chance.keys()
