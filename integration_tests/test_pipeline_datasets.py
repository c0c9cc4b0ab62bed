"""A user's verl-schema parquet (images by path and as bytes) and reward file train a tiny checkpoint through
the asynchronous pipeline at τ = 2; the ledger shows every row once per pass, and a resumed run continues the
exact sequence of prompts."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from relax_modalities import build_stream
from relax_services.control.checkpoint import CheckpointManager
from relax_services.control.controller import Controller
from relax_services.models.tiny_families import write_tiny_checkpoint
from relax_services.reporting.metrics import read_metrics
from relax_services.reporting.summary import format_summary

GOOD_ROWS = 24
SHUFFLE = 4

REWARD_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature. Raises for every fifth row, as a buggy user reward would."""
    if extra_info["index"] % 5 == 3:
        raise ValueError("reward bug on row %d" % extra_info["index"])
    return float(solution_str.strip() == ground_truth)
'''


def _png(colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (28, 28), colour).save(buf, "PNG")
    return buf.getvalue()


def _rows(folder: Path, n: int, prefix: str) -> list[dict[str, Any]]:
    rows = []
    for i in range(n):
        red = i % 2 == 0
        data = _png((220, 20, 20) if red else (20, 20, 220))
        if i % 3 == 0:  # a third of the rows name a file beside the parquet, the others carry the bytes
            (folder / f"{prefix}{i}.png").write_bytes(data)
            image: dict[str, Any] = {"bytes": None, "path": f"{prefix}{i}.png"}
        else:
            image = {"bytes": data, "path": None}
        rows.append(
            {
                "data_source": "geo/colour" if i % 4 < 2 else "geo/shade",
                "prompt": [{"role": "user", "content": "<image>which colour? r b"}],
                "images": [image],
                "ability": "vision",
                "reward_model": {"style": "rule", "ground_truth": "r" if red else "b"},
                "extra_info": {"index": i, "split": prefix},
            }
        )
    return rows


def _write_data(folder: Path) -> tuple[Path, Path, Path]:
    folder.mkdir(parents=True)
    train = _rows(folder, GOOD_ROWS, "train")
    train.insert(7, {**train[0], "images": [{"bytes": None, "path": "gone.png"}]})  # a bad row: row 7
    pq.write_table(pa.Table.from_pylist(train), folder / "train.parquet")
    pq.write_table(pa.Table.from_pylist(_rows(folder, 6, "test")), folder / "test.parquet")
    (folder / "my_reward.py").write_text(REWARD_FILE)
    return folder / "train.parquet", folder / "test.parquet", folder / "my_reward.py"


def _generated_ids(run_dir: Path) -> tuple[list[str], dict[str, Any]]:
    """Item ids of the newest checkpoint's ledger in the order the feeder drew them (regenerations of requeued
    prompts left out: they repeat their original's id by design), and the feeder state."""
    latest = CheckpointManager(run_dir / "checkpoints").latest()
    assert latest is not None
    feeder = CheckpointManager.load_controller(latest)["feeder"]
    ledger = feeder["ledger"]
    regenerated = set(ledger["requeued"].values())
    assert all(n == 1 for n in ledger["consumed"].values()), "a prompt was consumed twice"
    return [ledger["generated"][k] for k in sorted(ledger["generated"]) if k not in regenerated], feeder


def _expected_ids(train: Path, n: int) -> list[str]:
    """What the feeder must have drawn: the same files, schema, seed and buffer, read by relax-modalities."""
    stream = build_stream([train], shuffle_buffer=SHUFFLE, seed=0, epochs=None)
    return [f"{r.uid}@{r.epoch}" for r, _ in zip(stream, range(n), strict=False)]


@pytest.mark.integration
def test_user_parquet_and_reward_file_train_and_resume_exactly(small_config, run_pipeline, tmp_path: Path) -> None:
    train, test, reward = _write_data(tmp_path / "data")
    folder = write_tiny_checkpoint(tmp_path / "model", "qwen2.5-omni-thinker", seed=0)
    overrides = [
        f"model.source={folder}",
        f"data.train_files={train}",
        f"data.eval_files={test}",
        f"data.shuffle_buffer={SHUFFLE}",
        f"reward.fn={reward}:compute_score",
        "staleness.tau=2",
        "trainer.checkpoint_every=1",
    ]
    first = run_pipeline(small_config(*overrides, "trainer.total_steps=2"))
    assert (first.stop_reason, first.steps) == ("total_steps reached", 2)
    assert max(first.staleness_hist) <= 2
    assert first.ledger["duplicated"] == 0 and first.ledger["unknown"] == 0 and first.ledger["lost"] == 0
    # The raising reward is counted and recorded, never fatal.
    rewards = list(read_metrics(first.run_dir / "metrics.jsonl", "reward"))
    assert sum(r["failed"] for r in rewards) > 0
    assert any("reward bug on row" in (r["last_error"] or "") for r in rewards)
    # Held-out per data_source; the bad row named with its file and row.
    assert set(first.final_eval) == {"geo/colour", "geo/shade"}
    assert first.data is not None and first.data["bad_rows"] == 1
    assert first.data["recent_bad_rows"][0][:2] == [str(train), 7]
    checkpoints = list(read_metrics(first.run_dir / "metrics.jsonl", "checkpoint"))
    assert checkpoints and all(c["data"]["bad_rows"] == 1 for c in checkpoints)  # in the metrics as it runs
    text = format_summary(first)
    assert "bad rows skipped: 1" in text and "gone.png" in text and "held-out:" in text

    # Every row once per pass, in exactly the order an independent stream over the file gives.
    ids, feeder = _generated_ids(first.run_dir)
    assert ids == _expected_ids(train, len(ids))
    assert len(set(ids)) == len(ids)
    position = feeder["streams"]["dataset"]
    assert position["epoch"] == [0] and 0 < position["next_row"][0] < GOOD_ROWS + 1  # stopped mid-epoch

    # Resume from that checkpoint: the sequence continues, none repeated, none skipped.
    cfg = small_config(*overrides, "trainer.total_steps=5")
    resumed = Controller(cfg, first.run_dir, resume=True).run()
    assert resumed.steps == 5 and resumed.ledger["duplicated"] == 0 and resumed.ledger["lost"] == 0
    more, _ = _generated_ids(first.run_dir)
    assert more[: len(ids)] == ids and len(more) > len(ids)
    assert more == _expected_ids(train, len(more))
    for epoch in {i.rsplit("@", 1)[1] for i in more}:  # within a pass, each row at most once
        rows = [i for i in more if i.endswith(f"@{epoch}")]
        assert len(set(rows)) == len(rows)
