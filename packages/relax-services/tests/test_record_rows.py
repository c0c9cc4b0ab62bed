"""The distributed run's prompt path: the feeder puts record rows (no prompt built in the driver), a Rollout
worker builds the prompts, and a row whose media cannot be read is skipped and counted exactly as when the feeder
built the prompts itself: same skipped item, same bad-row report, same prompt ledger (the key taken out, as if
never generated), and the group's admission given back."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from test_datasets import _write

from relax_queue import QueueConfig, TaskSpec, TransferQueue
from relax_services._data import data_report, prepare_data
from relax_services.config import load_run_config
from relax_services.feeder import PromptFeeder
from relax_services.pipeline import queue_configs
from relax_services.services import RolloutService
from relax_services.weights import InProcessWeightStore


def _bad_row_files(tmp_path: Path) -> Path:
    path = _write(tmp_path / "d", n=4)
    table = pq.read_table(path).to_pylist()
    table[1]["images"] = [{"bytes": b"\x89PNG not really", "path": None}]  # parses, fails to decode
    pq.write_table(pa.Table.from_pylist(table), path)
    return path


def test_a_rollout_worker_skips_a_bad_row_and_the_feeder_counts_it_as_its_own(tmp_path: Path) -> None:
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
    from relax_services._data import finish_heldout

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
