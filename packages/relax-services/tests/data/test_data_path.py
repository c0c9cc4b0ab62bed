"""The one data path: the default run's synthetic tasks as per-task dataset files (cached, rewards routed by
data_source), the feeder's adaptive weights acting on the dataset stream's files, and chance levels of held-out
rows computed from the reward."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from relax_core import ConfigError, RewardRunnerConfig, RewardSpec, RowSchema
from relax_modalities import DataRecord, build_stream, parse_row
from relax_modalities.synthetic import read_manifest
from relax_queue import QueueConfig, TaskSpec, TransferQueue
from relax_services.config import RunConfig, load_run_config
from relax_services.data.chance import row_chance
from relax_services.data.feeder import PromptFeeder
from relax_services.data.files import train_stream
from relax_services.data.run_data import data_report, prepare_data, warmup_items
from relax_services.data.synthetic import HELDOUT_SEED_OFFSET, with_synthetic_files


def _cfg(tmp_path: Path, *overrides: str) -> RunConfig:
    (tmp_path / "data").mkdir(exist_ok=True)
    return load_run_config(
        None,
        [
            f"data.data_dir={tmp_path / 'data'}",
            "data.tasks=[image, text]",
            "data.train_per_task=6",
            "data.eval_per_task=3",
            *overrides,
        ],
    )


def test_default_data_are_per_task_files_written_once_with_routed_rewards(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "reward.routes.text.fn=math")
    resolved = with_synthetic_files(cfg)
    train, held = resolved.data.train_files, resolved.data.eval_files
    assert [Path(f.path).name for f in train] == ["image.jsonl", "text.jsonl"]
    assert [f.weight for f in train] == [1.0, 1.0]  # the even task mix
    assert all(Path(f.path).is_relative_to(tmp_path / "data") for f in [*train, *held])
    # Each task's data_source is routed to its answer check by name; a route the config gives is kept.
    assert resolved.reward.routes["image"].fn == "exact_match" and resolved.reward.routes["text"].fn == "math"
    # Rows: the schema's columns, data_source the task, ground truth the answer; held-out items are other items.
    records = list(build_stream([train[0].path, train[1].path], shuffle_buffer=0))
    assert len(records) == 12 and {r.data_source for r in records} == {"image", "text"}
    folder = Path(train[0].path).parent
    items = {it.id: it for it in read_manifest(folder / "manifest.jsonl")}
    for r in records:
        if r.data_source == "image":
            assert r.ground_truth == items[r.extra_info["id"]].answer and r.media[0].path is not None
    held_ids = {r.extra_info["id"] for r in build_stream([held[0].path], shuffle_buffer=0)}
    assert len(held_ids) == 3
    assert str(HELDOUT_SEED_OFFSET) in Path(held[0].path).parent.name
    # Written once: a second resolution reuses the very files.
    stamp = Path(train[0].path).stat().st_mtime_ns
    again = with_synthetic_files(cfg)
    assert [f.path for f in again.data.train_files] == [f.path for f in train]
    assert Path(train[0].path).stat().st_mtime_ns == stamp
    assert with_synthetic_files(resolved) is resolved  # a config naming files is left as it is


def test_default_data_take_the_dataset_path_with_chance_and_warmup_rows(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    data = prepare_data(cfg, tmp_path / "run")
    # Chance levels from the exact-match reward over each row's listed options: the generator's 1 / options.
    held = with_synthetic_files(cfg).data.eval_files
    expected = {}
    for spec in held:
        items = read_manifest(Path(spec.path).parent / "manifest.jsonl")
        expected[items[0].task] = sum(it.chance for it in items) / len(items)
    assert data.chance == pytest.approx(expected) and expected == pytest.approx({"image": 0.5, "text": 0.1})
    report = data_report(data)
    assert report["heldout_by_source"] == {"image": 3, "text": 3} and report["chance_unknown"] == {}
    rows = warmup_items(cfg)
    assert len(rows) == 12 and all(options for _, options in rows)
    assert {item["task"] for item, _ in rows} == {"image", "text"}


def _record(prompt: str, truth: object, data_source: str = "d", **extra: object) -> DataRecord:
    row = {"prompt": prompt, "answer": truth, "data_source": data_source, "extra_info": extra}
    return parse_row(row, RowSchema(), Path("."))


def test_chance_levels_where_the_reward_allows_and_why_not_elsewhere() -> None:
    rewards = RewardRunnerConfig(
        default=RewardSpec(fn="multiple_choice"),
        routes={"m": RewardSpec(fn="math"), "e": RewardSpec(fn="exact_match"), "u": RewardSpec(fn="pkg.mod:score")},
    )
    mcq = _record("Which?\nA. one\nB. two\nC. three\nD. four\nAnswer with the letter.", "C")
    assert row_chance(mcq, rewards) == (0.25, None)  # 4 labelled options, one right
    listed = _record("Which?", "B", choices=["A", "B", "C"])
    assert row_chance(listed, rewards) == (pytest.approx(1 / 3), None)
    exact = _record("colour?", "r", "e", options=["r", "g", "b", "y", "k"])
    assert row_chance(exact, rewards) == (pytest.approx(0.2), None)
    value, why = row_chance(_record("2+2?", "4", "m"), rewards)
    assert math.isnan(value) and "no choices" in str(why)
    value, why = row_chance(_record("2+2?", "4", "u", options=["4", "5"]), rewards)
    assert math.isnan(value) and "user or remote" in str(why)
    value, why = row_chance(_record("Which? A or B", "A"), rewards)  # no labelled options: unknown
    assert math.isnan(value)


def test_adaptive_weights_reach_the_stream_per_file_and_resume_with_it(tmp_path: Path) -> None:
    rows = {"a": ["s1"] * 20, "b": ["s2"] * 10 + ["s3"] * 10}
    specs = []
    for name, sources in rows.items():
        lines = [json.dumps({"prompt": f"{name}{i}", "answer": "x", "data_source": s}) for i, s in enumerate(sources)]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines))
        specs.append(f"{tmp_path / name}.jsonl")
    cfg = load_run_config(None, [f"data.train_files=[{specs[0]}, {specs[1]}]", "data.shuffle_buffer=0"])
    stream = train_stream(cfg.data)
    assert stream.stream.weights == [20.0, 20.0]  # unweighted files: by row count
    queue = TransferQueue(QueueConfig(tasks=(TaskSpec("rollout"),)))
    feeder = PromptFeeder(stream, lambda item: None, queue, queue, 1, adaptive=True, adaptive_floor=0.1)
    seen = [stream.next()["task"] for _ in range(40)]  # one pass over both files: every data_source seen
    assert set(seen) == {"s1", "s2", "s3"}
    feeder.observe({"s1": 1.0, "s2": 0.5}, momentum=0.0)
    # a: s1 → 1 − 1 + 0.1; b: mean of s2 (1 − 0.5 + 0.1) and s3 (no reward yet: 1.1); times the row counts.
    assert stream.stream.weights == pytest.approx([20 * 0.1, 20 * (0.6 + 1.1) / 2])
    state = json.loads(json.dumps(feeder.state_dict()))
    later = [stream.next()["id"] for _ in range(30)]
    again = train_stream(cfg.data)
    other = PromptFeeder(again, lambda item: None, queue, queue, 1, adaptive=True, adaptive_floor=0.1)
    other.load_state_dict(state)
    assert again.stream.weights == pytest.approx(stream.stream.weights)
    assert [again.next()["id"] for _ in range(30)] == later
    # A reward above 1 (a user's scale) weighs its file like a solved task instead of failing the stream.
    other.observe({"s1": 3.0, "s2": 3.0, "s3": 3.0}, momentum=0.0)
    assert again.stream.weights == pytest.approx([20 * 0.1, 20 * 0.1])
    queue.close()


def test_adaptive_floor_sets_the_solved_tasks_weight_and_is_checked(tmp_path: Path) -> None:
    specs = []
    for name in ("a", "b"):
        lines = [json.dumps({"prompt": f"{name}{i}", "answer": "x", "data_source": name}) for i in range(10)]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines))
        specs.append(f"{tmp_path / name}.jsonl")
    cfg = load_run_config(
        None, [f"data.train_files=[{specs[0]}, {specs[1]}]", "data.shuffle_buffer=0", "data.adaptive_floor=0.03"]
    )
    stream = train_stream(cfg.data)
    queue = TransferQueue(QueueConfig(tasks=(TaskSpec("rollout"),)))
    feeder = PromptFeeder(stream, lambda item: None, queue, queue, 1, adaptive=True, adaptive_floor=0.03)
    assert {stream.next()["task"] for _ in range(20)} == {"a", "b"}
    feeder.observe({"a": 1.0, "b": 0.5}, momentum=0.0)
    # a solved: the floor alone; b: 1 - 0.5 + 0.03; each times its 10 rows.
    assert stream.stream.weights == pytest.approx([10 * 0.03, 10 * 0.53])
    # 1000 draws now take b with probability 0.53 / 0.56: far more than the 0.6 / 0.7 the 0.1 floor gives.
    drawn = [stream.next()["task"] for _ in range(1000)]
    assert 0.9 < drawn.count("b") / 1000 < 0.99
    with pytest.raises(ValueError, match="adaptive_floor must be > 0"):
        PromptFeeder(stream, lambda item: None, queue, queue, 1, adaptive=True, adaptive_floor=0.0)
    queue.close()
    with pytest.raises(ConfigError, match=r"data\.adaptive_floor"):
        load_run_config(None, ["data.adaptive_floor=0"])


def test_a_checkpoint_with_per_task_streams_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text(json.dumps({"prompt": "p", "answer": "x"}))
    cfg = load_run_config(None, [f"data.train_files={tmp_path / 'a.jsonl'}"])
    queue = TransferQueue(QueueConfig(tasks=(TaskSpec("rollout"),)))
    feeder = PromptFeeder(train_stream(cfg.data), lambda item: None, queue, queue, 1, adaptive=True)
    old = {**feeder.state_dict(), "streams": {"image": {"epoch": 0, "cursor": 3}, "text": {"epoch": 1, "cursor": 0}}}
    with pytest.raises(ValueError, match=r"per-task streams \['image', 'text'\]"):
        feeder.load_state_dict(old)  # type: ignore[arg-type]
    queue.close()


def test_a_source_checkout_without_package_metadata_keys_the_files_by_the_generators_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run from a checkout (``src`` folders on ``PYTHONPATH``, nothing installed), relax-modalities has no version:
    the cache key is a digest of its generators' source instead, other than the installed version's key."""
    import relax_services.data.synthetic as synthetic

    cfg = _cfg(tmp_path)
    installed = with_synthetic_files(cfg).data.train_files

    def not_installed(name: str) -> str:
        raise synthetic.PackageNotFoundError(name)

    monkeypatch.setattr(synthetic, "version", not_installed)
    from_source = with_synthetic_files(cfg).data.train_files
    assert [Path(f.path).name for f in from_source] == [Path(f.path).name for f in installed]
    assert {Path(f.path).parent for f in from_source}.isdisjoint(Path(f.path).parent for f in installed)
    assert [f.path for f in with_synthetic_files(cfg).data.train_files] == [f.path for f in from_source]
