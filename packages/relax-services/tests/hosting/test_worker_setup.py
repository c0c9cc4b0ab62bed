"""A process on a machine without a GPU keeps triton out (``_worker_setup``): transformers' models import
``torch._dynamo`` as before, torch and transformers see triton as not installed, and a run trains to the very same
weights as one with triton loaded; where a GPU device exists, or ``RELAX_KEEP_TRITON=1``, nothing changes.

Each case runs in a fresh interpreter (the guard is an entry of ``sys.modules``, set once per process).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from relax_services.hosting.worker_setup import KEEP_TRITON_ENV, gpu_present

_PROBE = """
import importlib.util, json, os, sys
if sys.argv[2] == "triton-first":
    import triton
from relax_services.hosting.worker_setup import keep_triton_out
paths = {"no-gpu": (), "gpu": (sys.argv[1],), "triton-first": ()}[sys.argv[2]]
blocked = keep_triton_out(paths)
again = keep_triton_out(paths)
import transformers.masking_utils  # what every transformers model class imports (torch._dynamo at its top)
import torch.utils._triton
print(json.dumps({
    "blocked": blocked,
    "again": again,
    "dynamo": "torch._dynamo" in sys.modules,
    "triton_loaded": sys.modules.get("triton") is not None,
    "find_spec_none": importlib.util.find_spec("triton") is None,
    "torch_has_triton": torch.utils._triton.has_triton_package(),
}))
"""

_HAS_TRITON = importlib.util.find_spec("triton") is not None


def test_gpu_present_reads_the_device_paths(tmp_path: Path) -> None:
    device = tmp_path / "nvidia0"
    assert not gpu_present([str(tmp_path / "nvidia[0-9]*")])
    device.touch()
    assert gpu_present([str(tmp_path / "nvidia[0-9]*")])
    assert gpu_present([str(tmp_path / "absent"), str(device)])
    assert not gpu_present([])


def test_without_a_gpu_triton_stays_out_and_dynamo_still_imports(run_script, tmp_path: Path) -> None:
    out = run_script(_PROBE, str(tmp_path), "no-gpu")
    assert out["blocked"] is True and out["again"] is True  # idempotent
    assert out["dynamo"] is True  # the import that used to bring triton in still ran
    assert out["triton_loaded"] is False and out["find_spec_none"] is True and out["torch_has_triton"] is False


@pytest.mark.skipif(not _HAS_TRITON, reason="triton is not installed here: there is nothing to keep or block")
def test_with_a_gpu_device_nothing_changes(run_script, tmp_path: Path) -> None:
    device = tmp_path / "nvidiactl"
    device.touch()
    out = run_script(_PROBE, str(device), "gpu")
    assert out["blocked"] is False and out["again"] is False
    assert out["triton_loaded"] is True and out["find_spec_none"] is False and out["torch_has_triton"] is True


@pytest.mark.skipif(not _HAS_TRITON, reason="triton is not installed here: there is nothing to keep or block")
def test_the_environment_opt_out_and_an_earlier_import_keep_triton(
    run_script, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = run_script(_PROBE, str(tmp_path), "triton-first")  # imported already: it cannot be taken back
    assert out["blocked"] is False and out["triton_loaded"] is True
    monkeypatch.setenv(KEEP_TRITON_ENV, "1")  # the fresh interpreter inherits the test's environment
    out = run_script(_PROBE, str(tmp_path), "no-gpu")
    assert out["blocked"] is False and out["triton_loaded"] is True and out["torch_has_triton"] is True


_RUN = """
import json, sys
from pathlib import Path
from relax_services.hosting.worker_setup import keep_triton_out
blocked = keep_triton_out(() if sys.argv[2] == "blocked" else (sys.argv[1],))  # an existing path: as on a GPU box
import torch
from relax_services.control.checkpoint import CheckpointManager
from relax_services.control.colocated import ColocatedController
from relax_services.config import load_run_config

out = Path(sys.argv[1])
cfg = load_run_config(None, [
    "data.train_per_task=16", "data.eval_per_task=8", "data.tasks=[text]", "data.adaptive_weights=false",
    "trainer.groups_per_step=4", "trainer.micro_batch_groups=2", "trainer.target_reward=null",
    "trainer.warmup_format_steps=0", "trainer.total_steps=2", "rollout.groups_per_call=2", "eval.every_steps=1000",
    "run.progress=none", "algorithm.group_size=4", "algorithm.kl_coef=0.0", "staleness.tau=0", "run.mode=colocated",
    f"run.output_dir={out}", "run.name=run",
])
run_dir = out / "run"
run_dir.mkdir(parents=True)
result = ColocatedController(cfg, run_dir).run()
state = CheckpointManager.load_engine(CheckpointManager(run_dir / "checkpoints").latest())
torch.save(state["model"], out / "model.pt")
print(json.dumps({"blocked": blocked, "steps": result.steps, "error": result.error,
                  "triton_loaded": sys.modules.get("triton") is not None, "dynamo": "torch._dynamo" in sys.modules}))
"""


@pytest.mark.integration
@pytest.mark.slow  # out of the default suite for its 12-minute budget
def test_a_run_without_triton_builds_and_trains_the_model_to_the_same_weights(run_script, tmp_path: Path) -> None:
    """The model is built, generates, is scored and trained with triton kept out; the weights after two τ = 0
    updates equal, bit for bit, those of the same run with triton left importable."""
    runs = {}
    for mode in ("blocked", "kept"):
        folder = tmp_path / mode
        folder.mkdir()
        runs[mode] = run_script(_RUN, str(folder), mode)
        assert runs[mode]["error"] is None and runs[mode]["steps"] == 2, runs[mode]
        assert runs[mode]["dynamo"] is True
    assert runs["blocked"]["blocked"] is True and runs["blocked"]["triton_loaded"] is False
    assert runs["kept"]["blocked"] is False and runs["kept"]["triton_loaded"] is _HAS_TRITON
    blocked = torch.load(tmp_path / "blocked" / "model.pt")
    kept = torch.load(tmp_path / "kept" / "model.pt")
    assert blocked.keys() == kept.keys() and blocked
    assert [k for k in kept if not torch.equal(blocked[k], kept[k])] == []
