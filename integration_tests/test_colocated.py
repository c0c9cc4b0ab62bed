"""Colocated mode (``run.mode=colocated``): the same services as threads of one process, no Ray.

τ = 0 must reproduce the synchronous sequential trainer bit for bit (the reference loop of
``test_pipeline_sync_equivalence.py``, from the integration conftest); τ = 2 must keep every consumed sample at
most 2 versions stale, counted both by the queue and from the per-token versions the rollout recorded; the run
ends with a complete checkpoint whose ledger lost nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from relax_services.control.checkpoint import CheckpointManager
from relax_services.control.colocated import ColocatedController, check_colocated
from relax_services.engines.torch import build_train_engine
from relax_services.models.policy import build_policy
from relax_services.reporting.footprint import update_split
from relax_services.reporting.metrics import read_metrics

STEPS = 3


TAU0 = (
    "run.mode=colocated",
    "staleness.tau=0",
    f"trainer.total_steps={STEPS}",
    "data.adaptive_weights=false",
    "data.tasks=[image, text]",
    "algorithm.kl_coef=0.0",
)
"""The colocated τ = 0 run both equivalence tests compare with the sequential trainer."""


def _run(cfg: object, tmp_path: Path) -> tuple[object, Path]:
    run_dir = tmp_path / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    return ColocatedController(cfg, run_dir).run(), run_dir  # type: ignore[arg-type]


@pytest.mark.integration
def test_colocated_tau0_equals_sequential_trainer(small_config, sequential_weights, tmp_path: Path) -> None:
    cfg = small_config(*TAU0)
    ray_before = "ray" in sys.modules and sys.modules["ray"].is_initialized()  # another test's session, if any
    result, run_dir = _run(cfg, tmp_path)
    if not ray_before:  # no Ray was started
        assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
    assert result.steps == STEPS
    assert result.staleness_hist == {0: STEPS * cfg.samples_per_step}  # strictly on-policy
    assert result.ledger["lost"] == 0
    latest = CheckpointManager(run_dir / "checkpoints").latest()
    assert latest is not None
    state = CheckpointManager.load_engine(latest)
    assert state["version"] == STEPS

    expected = sequential_weights(cfg, tmp_path / "sequential", STEPS)
    initial = build_policy(cfg.model).state_dict()
    assert any(not torch.equal(initial[k], expected[k]) for k in expected), "the reference loop did not train"
    mismatched = [k for k in expected if not torch.equal(state["model"][k], expected[k])]
    assert not mismatched, f"{len(mismatched)} tensors differ, e.g. {mismatched[:3]}"

    split = update_split(run_dir / "metrics.jsonl")
    assert split is not None and split.updates == STEPS


@pytest.mark.integration
def test_colocated_tau0_with_lora_equals_sequential_trainer(small_config, sequential_weights, tmp_path: Path) -> None:
    """``model.lora``: the checkpoint holds the adapters alone, and merged into the frozen weights they are the
    synchronous trainer's weights bit for bit."""
    cfg = small_config(
        *TAU0,
        "model.lora={rank: 4, alpha: 8, target_modules: [q_proj, v_proj, o_proj]}",
    )
    result, run_dir = _run(cfg, tmp_path)
    assert result.steps == STEPS
    assert result.staleness_hist == {0: STEPS * cfg.samples_per_step}
    latest = CheckpointManager(run_dir / "checkpoints").latest()
    assert latest is not None
    state = CheckpointManager.load_engine(latest)
    assert state["version"] == STEPS
    assert state["model"] and all(".lora_A." in k or ".lora_B." in k for k in state["model"])
    resumed = build_train_engine(cfg)
    resumed.load_state_dict(state)
    merged = resumed.policy_state()

    expected = sequential_weights(cfg, tmp_path / "sequential", STEPS)
    initial = build_policy(cfg.model).state_dict()
    trained = [k for k in expected if not torch.equal(initial[k], expected[k])]
    assert trained and all(k.endswith(("q_proj.weight", "v_proj.weight", "o_proj.weight")) for k in trained)
    mismatched = [k for k in expected if not torch.equal(merged[k], expected[k])]
    assert not mismatched, f"{len(mismatched)} tensors differ, e.g. {mismatched[:3]}"


@pytest.mark.integration
def test_colocated_tau2_keeps_staleness_bounded(small_config, tmp_path: Path) -> None:
    steps = 5
    cfg = small_config("run.mode=colocated", "staleness.tau=2", f"trainer.total_steps={steps}")
    result, run_dir = _run(cfg, tmp_path)
    assert result.steps == steps
    assert sum(result.staleness_hist.values()) == steps * cfg.samples_per_step
    assert max(result.staleness_hist) <= 2
    trains = list(read_metrics(run_dir / "metrics.jsonl", "train"))
    assert len(trains) == steps
    for record in trains:  # recomputed from the rollout's per-token versions, independent of the queue
        assert max(int(k) for k in record["token_staleness_hist"]) <= 2
    assert result.ledger["lost"] == 0


def test_colocated_rejects_what_one_process_cannot_do(small_config) -> None:
    with pytest.raises(ValueError, match=r"run\.ray_address"):
        check_colocated(small_config("run.mode=colocated", "run.ray_address=127.0.0.1:6379"))
    with pytest.raises(ValueError, match=r"run\.placement"):
        check_colocated(small_config("run.mode=colocated", "run.placement={trainer: gpu_node}"))


def _events(run_dir: Path) -> list[dict[str, object]]:
    return list(read_metrics(run_dir / "metrics.jsonl", "health"))


def _divergence(
    checkpoints: CheckpointManager, trace: dict[int, dict[str, torch.Tensor]], events: list[dict[str, object]]
) -> str:
    """Where a run left the sequential trainer: each checkpoint's version (its saved one too, when the folder's
    differs), the tensors that differ by top-level module, and the largest difference; and the restarts."""
    lines = []
    for step in checkpoints.steps():
        state = CheckpointManager.load_engine(checkpoints.path(step))
        version = int(state["version"])
        reference = trace.get(version)
        if reference is None:
            lines.append(f"checkpoint {step}: version {version}, no reference")
            continue
        differ = [k for k in reference if not torch.equal(state["model"][k], reference[k])]
        modules: dict[str, int] = {}
        for k in differ:
            modules[k.split(".")[0]] = modules.get(k.split(".")[0], 0) + 1
        worst = max((float((state["model"][k] - reference[k]).abs().max()) for k in differ), default=0.0)
        lines.append(f"checkpoint {step} (version {version}): {len(differ)} differ {modules} max |diff| {worst:.3g}")
    restarts = [(e["event"], e.get("step")) for e in events if e["event"] in ("global_restart", "recovered")]
    return "; ".join(lines) + f"; restarts {restarts}"


@pytest.mark.integration
def test_colocated_restarts_a_failed_service_in_place(small_config, tmp_path: Path) -> None:
    steps = 6
    cfg = small_config(
        "run.mode=colocated",
        "staleness.tau=2",
        f"trainer.total_steps={steps}",
        # at step 0: injected before the first update, so the run cannot finish before the fault lands (six
        # updates take a fraction of a second in one process)
        "faults=[{service: reward, kind: raise, at_step: 0}]",
    )
    result, run_dir = _run(cfg, tmp_path)
    assert result.steps == steps
    events = _events(run_dir)
    detected = next(e for e in events if e["event"] == "detected" and e["service"] == "reward")
    assert "injected fault" in str(detected["reason"])
    assert any(e["event"] == "restarted" and e["service"] == "reward" for e in events), events
    assert result.ledger["lost"] == 0 and result.ledger["duplicated"] == 0


@pytest.mark.integration
@pytest.mark.slow  # ~16 s; out of the default suite for its 12-minute budget (colocated faults: restarts in place)
def test_colocated_failed_trainer_resumes_from_checkpoint_exactly(
    small_config, sequential_weights, tmp_path: Path
) -> None:
    """τ = 0: the Trainer's loop raises once it has passed step 3 (the controller notices within one tick, a few
    updates later in one process); the run restarts from its last checkpoint and, at the end, holds exactly the
    weights of an uninterrupted synchronous trainer."""
    steps = 40
    cfg = small_config(
        "run.mode=colocated",
        "staleness.tau=0",
        f"trainer.total_steps={steps}",
        "trainer.checkpoint_every=2",
        "rollout.groups_per_call=1",
        "data.adaptive_weights=false",
        "data.tasks=[image, text]",
        "algorithm.kl_coef=0.0",
        "faults=[{service: trainer, kind: raise, at_step: 3}]",
        f"trainer.keep_checkpoints={steps}",  # every checkpoint stays: a mismatch is traced to its first update
    )
    result, run_dir = _run(cfg, tmp_path)
    events = _events(run_dir)
    assert any(e["event"] == "global_restart" for e in events), events
    assert any(e["event"] == "recovered" for e in events), events
    checkpoints = CheckpointManager(run_dir / "checkpoints", keep=steps)
    latest = checkpoints.latest()
    assert latest is not None
    state = CheckpointManager.load_engine(latest)
    assert state["version"] == steps
    trace: dict[int, dict[str, torch.Tensor]] = {}
    expected = sequential_weights(cfg, tmp_path / "sequential", steps, trace=trace)
    mismatched = [k for k in expected if not torch.equal(state["model"][k], expected[k])]
    assert not mismatched, f"{len(mismatched)} tensors differ after resume, e.g. {mismatched[:3]}; " + _divergence(
        checkpoints, trace, events
    )
    assert result.ledger["lost"] == 0 and result.ledger["duplicated"] == 0
