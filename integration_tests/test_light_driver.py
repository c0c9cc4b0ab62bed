"""The driver of a distributed run (the ``relax train`` process) never imports the model stack: torch and
transformers are loaded only by the services, the warm-up task and the checkpoint check's child process."""

from __future__ import annotations

import json

import pytest


@pytest.mark.integration
def test_a_distributed_run_s_driver_never_loads_torch_or_transformers(cli_run) -> None:
    # The conftest's CLI run (CLI_FAST, shared with test_cli_and_cluster.py) warms up (its own task), checkpoints
    # with the HF export, evaluates and builds media prompts: every path that once ran in the driver.
    proc, run_dir = cli_run.proc, cli_run.run_dir
    assert cli_run.verdict == {"code": 0, "modules": [], "libtorch": False}, proc.stdout[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = next(r for r in records if r["kind"] == "summary")
    assert summary["stop_reason"] == "total_steps reached"
    assert max(r["step"] for r in records if r["kind"] == "train") == 4
    assert summary["ledger"]["lost"] == 0 and summary["ledger"]["duplicated"] == 0
    assert summary["ledger"]["consumed"] == 4 * 4  # 4 updates of 4 groups, each prompt once
    # The Evaluator's report reached the driver: 4 held-out rows per task, none skipped.
    assert summary["data"]["heldout_by_source"] == {"audio": 4, "image": 4, "text": 4, "video": 4}
    assert summary["skipped_media"]["heldout"] == {}
    evals = [r for r in records if r["kind"] == "eval"]
    assert evals and set(evals[-1]["chance"]) == {"audio", "image", "text", "video"}
    assert (run_dir / "checkpoints" / "step_00000004" / "hf" / "model.safetensors").is_file()
