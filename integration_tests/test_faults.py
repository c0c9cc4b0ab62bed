"""Fault isolation and lossless recovery: injected kills and hangs are detected, the service comes back, the
trainer keeps going, and the ledger of prompt keys is exact (nothing lost, nothing trained on twice)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relax_services.control.checkpoint import CheckpointManager
from relax_services.reporting.metrics import read_metrics


def _events(run_dir: Path) -> list[dict]:
    return list(read_metrics(run_dir / "metrics.jsonl", "health"))


def _assert_exact_ledger(result, steps: int, groups_per_step: int) -> None:
    ledger = result.ledger
    assert ledger["lost"] == 0, ledger
    assert ledger["duplicated"] == 0 and ledger["unknown"] == 0, ledger
    assert ledger["consumed"] == steps * groups_per_step, ledger


@pytest.mark.integration
def test_killed_rollout_restarts_while_trainer_keeps_consuming(small_config, run_pipeline) -> None:
    # The kill lands once two updates' worth of samples wait for the trainer, so the outage overlaps queued work
    # whatever the timing (without the condition, the trainer had sometimes drained the queue already). Four PPO
    # epochs per update make the trainer the slower side, so such a backlog does build up within τ = 4.
    cfg = small_config(
        "staleness.tau=4",
        "trainer.total_steps=30",
        "trainer.ppo_epochs=4",
        "data.tasks=[image, text]",
        "faults=[{service: rollout, kind: kill, at_step: 3, min_trainer_backlog: 32}]",
        "queue.lease_timeout_s=5",
    )
    assert cfg.samples_per_step == 16
    result = run_pipeline(cfg)
    assert result.steps == 30
    events = _events(result.run_dir)
    kinds = [(e["event"], e["service"]) for e in events]
    assert ("injected", "rollout-0") in kinds and ("restarted", "rollout-0") in kinds, kinds
    injected = next(e for e in events if e["event"] == "injected")
    detected = next(e for e in events if e["event"] == "detected" and e["wall"] >= injected["wall"])
    restarted = next(e for e in events if e["event"] == "restarted" and e["wall"] >= detected["wall"])
    assert "died" in detected["reason"]
    # The trainer kept updating on what was queued while the rollout was down (killed → back). Compared on the
    # time each process stamped (the controller ingests the trainer's records only after the restart it waits on).
    train = list(read_metrics(result.run_dir / "metrics.jsonl", "train"))
    steps_during = [r["step"] for r in train if injected["time"] <= r["time"] <= restarted["time"]]
    assert steps_during, ("no update happened during the rollout outage", injected, restarted, train)
    _assert_exact_ledger(result, 30, cfg.trainer.groups_per_step)


@pytest.mark.slow
@pytest.mark.integration
def test_hung_reference_is_detected_and_restarted(small_config, run_pipeline) -> None:
    cfg = small_config(
        "staleness.tau=2",
        "trainer.total_steps=30",
        "algorithm.kl_coef=0.01",
        "data.tasks=[audio, text]",
        "faults=[{service: reference, kind: hang, at_step: 2}]",
        "health.heartbeat_timeout_s=4",
        "queue.lease_timeout_s=5",
    )
    assert cfg.algorithm.uses_reference
    result = run_pipeline(cfg)
    assert result.steps == 30
    events = _events(result.run_dir)
    injected = next(e for e in events if e["event"] == "injected")
    detected = next(e for e in events if e["event"] == "detected" and e["service"] == "reference")
    assert "hung" in detected["reason"]
    assert detected["wall"] - injected["wall"] < 4 + 10  # within the timeout (plus polling slack)
    assert any(e["event"] == "restarted" and e["service"] == "reference" for e in events)
    _assert_exact_ledger(result, 30, cfg.trainer.groups_per_step)


@pytest.mark.slow  # passes alone; once failed (weights differed) on a machine loaded by a parallel benchmark
@pytest.mark.integration
def test_killed_trainer_resumes_from_checkpoint_exactly(small_config, run_pipeline, sequential_weights, tmp_path):
    """τ = 0: kill the Trainer after step 3; the run restarts from its step-2 checkpoint and, at step 6, holds
    exactly the weights of an uninterrupted synchronous trainer."""
    steps = 6
    cfg = small_config(
        "staleness.tau=0",
        f"trainer.total_steps={steps}",
        "trainer.checkpoint_every=2",
        "rollout.groups_per_call=1",
        "data.adaptive_weights=false",
        "data.tasks=[image, text]",
        "algorithm.kl_coef=0.0",
        "faults=[{service: trainer, kind: kill, at_step: 3}]",
    )
    result = run_pipeline(cfg)
    events = _events(result.run_dir)
    assert any(e["event"] == "global_restart" for e in events), events
    assert any(e["event"] == "recovered" for e in events), events
    latest = CheckpointManager(result.run_dir / "checkpoints").latest()
    state = CheckpointManager.load_engine(latest)
    assert state["version"] == steps
    expected = sequential_weights(cfg, tmp_path / "sequential", steps)
    mismatched = [k for k in expected if not torch.equal(state["model"][k], expected[k])]
    assert not mismatched, f"{len(mismatched)} tensors differ after resume, e.g. {mismatched[:3]}"
    assert result.ledger["lost"] == 0 and result.ledger["duplicated"] == 0


@pytest.mark.slow
@pytest.mark.integration
def test_soak_repeated_random_faults_all_recovered(small_config, run_pipeline) -> None:
    """Several minutes of training with a fault every few steps (kills, raises and hangs of every service,
    the Trainer included): every fault is recovered from and the ledger stays exact."""
    from relax_services.bench.chaos import CHAOS_DEFAULTS, fault_table, random_faults

    cfg = small_config(*CHAOS_DEFAULTS, "trainer.total_steps=120", "trainer.max_minutes=15", "run.progress=none")
    cfg = cfg.model_copy(update={"faults": random_faults(10, seed=7, total_steps=cfg.trainer.total_steps)})
    result = run_pipeline(cfg)
    table = fault_table(result.health_events, result.ledger)
    assert result.steps == 120, table
    assert "all recovered: yes" in table, table
    assert result.ledger["lost"] == 0 and result.ledger["duplicated"] == 0, table
