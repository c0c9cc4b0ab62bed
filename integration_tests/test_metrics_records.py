"""A short colocated run with every metrics sink: ``metrics.jsonl`` is strict JSON for every record kind it holds
(with a user's data and reward, whose chance level is unknown: NaN, written as null and flagged), and TensorBoard,
MLflow and W&B hold the same scalars, histograms and config, read back with each library's reader.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from relax_services.control.colocated import ColocatedController

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "relax-services" / "tests" / "reporting"))
from sink_readers import mlflow_run, tensorboard_run, wandb_config, wandb_history

STEPS = 2

REWARD_FILE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.strip() == ground_truth)
"""


def _user_data(folder: Path) -> tuple[Path, Path, Path]:
    """Text rows in the verl schema that list no answer options (so no chance level is known), and a reward file."""
    folder.mkdir()
    for name, n in (("train", 16), ("test", 4)):
        rows = [
            {
                "data_source": "sums",
                "prompt": [{"role": "user", "content": f"{i % 5}+{i % 3}="}],
                "reward_model": {"style": "rule", "ground_truth": str(i % 5 + i % 3)},
                "extra_info": {"index": i},
            }
            for i in range(n)
        ]
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "reward.py").write_text(REWARD_FILE)
    return folder / "train.jsonl", folder / "test.jsonl", folder / "reward.py"


def _refuse(constant: str) -> float:
    raise ValueError(f"not strict JSON: {constant}")


@pytest.mark.integration
def test_a_run_writes_strict_records_and_the_same_metrics_to_every_sink(small_config, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    train_file, test_file, reward = _user_data(tmp_path / "data")
    cfg = small_config(
        "run.mode=colocated",
        f"trainer.total_steps={STEPS}",
        "eval.every_steps=1",
        f"data.train_files={train_file}",
        f"data.eval_files={test_file}",
        f"reward.fn={reward}:compute_score",
        "metrics.sinks=[tensorboard, wandb, mlflow]",
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    result = ColocatedController(cfg, run_dir).run()
    assert result.steps == STEPS
    # the summary's comparison for learning from reward alone has an earlier evaluation to go by
    assert result.final_version == STEPS and result.first_eval_version is not None
    assert result.first_eval_version < STEPS and set(result.first_eval) == {"sums"}

    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    records = [json.loads(line, parse_constant=_refuse) for line in lines]  # every line, strictly
    kinds = {r["kind"] for r in records}
    assert {"train", "eval", "rollout", "reward", "queue", "checkpoint", "summary"} <= kinds, kinds
    for r in records:
        for dotted in r.get("nonfinite", []):
            node = r
            for part in dotted.split("."):
                node = node[int(part)] if isinstance(node, list) else node[part]
            assert node is None, (r["kind"], dotted)
    evals = [r for r in records if r["kind"] == "eval"]
    assert evals and all(r["chance"] == {"sums": None} and r["nonfinite"] == ["chance.sums"] for r in evals)
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))

    tb = tensorboard_run(run_dir)
    client, run_id = mlflow_run(run_dir)
    history = wandb_history(run_dir)
    for field in ("loss", "reward", "samples", "wait_s", "reward_by_task/sums"):
        tag = f"train/{field}"
        expected = {r["step"]: float(r[field] if "/" not in field else r["reward_by_task"]["sums"]) for r in train}
        # TensorBoard stores a scalar as float32: the record's value rounded once to float32
        assert {e.step: e.value for e in tb.Scalars(tag)} == {s: float(np.float32(v)) for s, v in expected.items()}
        assert {m.step: m.value for m in client.get_metric_history(run_id, tag)} == expected
        assert {int(h["train/step"]): h[tag] for h in history if tag in h} == expected
    mlflow_eval = {(m.step, m.value) for m in client.get_metric_history(run_id, "eval/reward/sums")}
    assert mlflow_eval == {(r["version"], r["reward"]["sums"]) for r in evals}
    assert "eval/chance/sums" not in tb.Tags()["scalars"]  # a NaN is flagged in the file, not charted

    for r in train:  # the histograms: the update's staleness counts and its rewards
        staleness = sorted(int(k) for k, n in r["staleness_hist"].items() for _ in range(n))
        (tb_hist,) = [e.histogram_value for e in tb.Histograms("train/staleness") if e.step == r["step"]]
        assert (tb_hist.num, tb_hist.min, tb_hist.max) == (len(staleness), staleness[0], staleness[-1])
        assert sum(tb_hist.bucket) == r["samples"] == len(r["rewards"])
        path = client.download_artifacts(run_id, f"histograms/train/rewards/step_{r['step']:06d}.json", str(tmp_path))
        saved = json.loads(Path(path).read_text())
        assert saved["counts"] == [int(c) for c in np.histogram(r["rewards"], bins=saved["edges"])[0]]
        (wb,) = [h for h in history if h.get("train/step") == r["step"] and "train/staleness/_type" in h]
        assert sum(wb["train/staleness/values"]) == len(staleness)

    config_text = (run_dir / "config.yaml").read_text(encoding="utf-8")
    assert tb.Tensors("config")[0].tensor_proto.string_val[0].decode() == config_text
    assert client.get_run(run_id).data.params["trainer.total_steps"] == str(STEPS)
    assert wandb_config(run_dir)["trainer"] == yaml.safe_load(config_text)["trainer"]
