"""The driver of a distributed run (the ``relax train`` process) never imports the model stack: torch and
transformers are loaded only by the services, the warm-up task and the checkpoint check's child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ENV = {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "OMP_NUM_THREADS": "1", "RAY_memory_monitor_refresh_ms": "0"}
FAST = [  # test_cli_and_cluster's run: warm-up, checkpoints with the HF export, evaluations, every media task
    "data.train_per_task=8",
    "data.eval_per_task=4",
    "data.tasks=[image, audio, video, text]",
    "trainer.groups_per_step=4",
    "trainer.micro_batch_groups=4",
    "trainer.total_steps=4",
    "trainer.warmup_format_steps=2",
    "trainer.checkpoint_every=2",
    "algorithm.group_size=4",
    "eval.every_steps=2",
    "run.report_every_s=1",
]

_DRIVER = """
import json, sys
from relax_services.cli import main
code = main(["train", *sys.argv[1:]])
maps = open("/proc/self/maps").read()  # the shared libraries mapped into this process
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
print(json.dumps({"code": code, "modules": heavy, "libtorch": "libtorch" in maps}))
"""


@pytest.mark.integration
def test_a_distributed_run_s_driver_never_loads_torch_or_transformers(tmp_path: Path) -> None:
    # FAST warms up (its own task), checkpoints with the HF export, evaluates and builds media prompts: every path
    # that once ran in the driver.
    args = [*FAST, f"run.output_dir={tmp_path}", "run.name=light"]
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, *args], capture_output=True, text=True, timeout=900, env=ENV, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    verdict = json.loads(proc.stdout.strip().splitlines()[-1])
    assert verdict == {"code": 0, "modules": [], "libtorch": False}, proc.stdout[-3000:]
    records = [json.loads(line) for line in (tmp_path / "light" / "metrics.jsonl").read_text().splitlines()]
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
    assert (tmp_path / "light" / "checkpoints" / "step_00000004" / "hf" / "model.safetensors").is_file()
