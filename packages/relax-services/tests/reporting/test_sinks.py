"""The metrics sinks: the digest of a record (scalars, histograms), each sink read back with its library's own
reader, and the config error of a sink whose package is missing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from relax_core import ConfigError
from relax_services.config import load_run_config
from relax_services.reporting.metrics import MetricsWriter
from relax_services.reporting.sinks import SinkFanout, digest, histogram_of, open_sinks

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sink_readers import mlflow_run, tensorboard_run, wandb_config, wandb_history

TRAIN = [
    {"step": 1, "loss": 0.75, "reward": 0.25, "reward_by_task": {"text": 0.25}, "samples": 4,
     "staleness_hist": {"0": 3, "1": 1}, "rewards": [0.0, 0.0, 1.0, 0.0], "keys": ["a"], "final": False},
    {"step": 2, "loss": float("nan"), "reward": 0.5, "reward_by_task": {"text": 0.5}, "samples": 4,
     "staleness_hist": {"2": 4}, "rewards": [1.0, 0.0, 1.0, 0.0]},
]  # fmt: skip
"""Two updates' records as the Trainer writes them (the second with a non-finite loss)."""


def test_histogram_bins_integers_one_per_value_and_floats_in_equal_widths() -> None:
    h = histogram_of([0, 0, 0, 2])
    assert h.edges == [-0.5, 0.5, 1.5, 2.5] and h.counts == [3, 0, 1]
    h = histogram_of([0.0, 0.1, 0.25, 1.0])  # 20 bins of 0.05 over [0, 1]; 1.0 is in the last (closed) bin
    assert len(h.counts) == 20 and h.counts[0] == 1 and h.counts[2] == 1 and h.counts[5] == 1 and h.counts[19] == 1
    assert h.counts == [int(c) for c in np.histogram([0.0, 0.1, 0.25, 1.0], bins=20, range=(0.0, 1.0))[0]]
    assert histogram_of([0.3, 0.3]).counts == [2]
    wide = histogram_of([0, 64])  # integers over 65 values: 20 equal bins of 3.2, not 65 bins of 1
    assert len(wide.counts) == 20 and wide.counts[0] == wide.counts[-1] == 1


def test_digest_keeps_every_finite_number_at_the_records_step() -> None:
    item = digest("train", TRAIN[0])
    assert item is not None and item.step == 1
    assert item.scalars == {
        "train/step": 1.0, "train/loss": 0.75, "train/reward": 0.25, "train/reward_by_task/text": 0.25,
        "train/samples": 4.0,
    }  # fmt: skip
    assert item.histograms["train/staleness"].counts == [3, 1]
    assert item.histograms["train/rewards"].counts == [3, 1]
    assert "train/loss" not in digest("train", {**TRAIN[1], "loss": None}).scalars  # type: ignore[union-attr]
    assert digest("queue", {"depth_rows": 3}) is None  # kinds without a step are not charted


def _write_run(run_dir: Path, sinks: list[str]) -> str:
    cfg = load_run_config(None, ["trainer.total_steps=7", f"metrics.sinks={sinks}"])
    text = "trainer:\n  total_steps: 7\n"
    writer = MetricsWriter(run_dir / "metrics.jsonl")
    writer.sinks = SinkFanout(open_sinks(cfg.metrics.sinks, run_dir, cfg.model_dump(mode="json"), text, cfg.metrics))
    for record in TRAIN:
        writer.write("train", record)
    writer.write("eval", {"version": 2, "reward": {"text": 0.375}, "chance": {"text": float("nan")}})
    writer.write("rollout", {"version": 1, "samples": 8, "seconds": 1.5})
    writer.write("queue", {"depth_rows": 3})
    writer.close()
    assert writer.sinks.dropped == {}
    return text


def test_tensorboard_holds_the_scalars_histograms_and_config(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    text = _write_run(tmp_path, ["tensorboard"])
    tb = tensorboard_run(tmp_path)
    assert [(e.step, e.value) for e in tb.Scalars("train/loss")] == [(1, 0.75)]  # the NaN loss is not charted
    assert [(e.step, e.value) for e in tb.Scalars("train/reward_by_task/text")] == [(1, 0.25), (2, 0.5)]
    assert [(e.step, e.value) for e in tb.Scalars("eval/reward/text")] == [(2, 0.375)]
    assert "eval/chance/text" not in tb.Tags()["scalars"]
    assert [(e.step, e.value) for e in tb.Scalars("rollout/seconds")] == [(1, 1.5)]
    first, second = (e.histogram_value for e in tb.Histograms("train/staleness"))
    assert (first.num, first.min, first.max, first.sum, first.sum_squares) == (4, 0, 1, 1, 1)
    assert list(first.bucket_limit) == [0.5, 1.5] and list(first.bucket) == [3, 1]
    assert (second.num, list(second.bucket)) == (4, [4])
    assert tb.Tensors("config")[0].tensor_proto.string_val == [text.encode()]


def test_mlflow_holds_the_scalars_histograms_and_config(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    text = _write_run(tmp_path, ["mlflow"])
    client, run_id = mlflow_run(tmp_path)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train/reward")] == [(1, 0.25), (2, 0.5)]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")] == [(1, 0.75)]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "eval/reward/text")] == [(2, 0.375)]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["trainer.total_steps"] == "7" and run.data.params["metrics.project"] == "relax"
    path = client.download_artifacts(run_id, "histograms/train/rewards/step_000002.json", str(tmp_path / "dl"))
    assert json.loads(Path(path).read_text()) == {"step": 2, "edges": [-0.5, 0.5, 1.5], "counts": [2, 2]}
    assert Path(client.download_artifacts(run_id, "config.yaml", str(tmp_path / "dl"))).read_text() == text


def test_wandb_offline_holds_the_scalars_histograms_and_config(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    _write_run(tmp_path, ["wandb"])
    history = wandb_history(tmp_path)
    train = [h for h in history if "train/step" in h]
    assert [(h["train/step"], h["train/reward"]) for h in train] == [(1, 0.25), (2, 0.5)]
    assert [h.get("train/loss") for h in train] == [0.75, None]
    assert train[0]["train/staleness/_type"] == "histogram"
    assert (train[0]["train/staleness/values"], train[0]["train/staleness/bins"]) == ([3, 1], [-0.5, 0.5, 1.5])
    assert [(h["eval/version"], h["eval/reward/text"]) for h in history if "eval/version" in h] == [(2, 0.375)]
    assert wandb_config(tmp_path)["trainer"]["total_steps"] == 7
    assert yaml.safe_dump(wandb_config(tmp_path)["metrics"]["sinks"]) == "- jsonl\n- wandb\n"


@pytest.mark.parametrize("sink", ["tensorboard", "wandb", "mlflow"])
def test_a_sink_without_its_package_is_a_config_error_naming_the_extra(
    sink: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, sink, None)  # the package cannot be imported (find_spec answers None)
    with pytest.raises(ConfigError, match=rf"metrics\.sinks.*relax-services\[{sink}\]"):
        load_run_config(None, [f"metrics.sinks=[{sink}]"])


def test_jsonl_is_always_on_and_sinks_are_listed_once() -> None:
    assert load_run_config(None, []).metrics.sinks == ["jsonl"]
    assert load_run_config(None, ["metrics.sinks=[]"]).metrics.sinks == ["jsonl"]
    with pytest.raises(ConfigError, match=r"metrics\.sinks"):
        load_run_config(None, ["metrics.sinks=[csv]"])
