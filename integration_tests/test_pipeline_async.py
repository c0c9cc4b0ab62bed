"""The asynchronous pipeline: τ is honoured, every service runs in its own process (``run.hosts=[]``), and the
reward rises."""

from __future__ import annotations

import math
import os
from pathlib import Path

import psutil
import pytest

from relax_services.reporting.metrics import read_metrics


def _token_staleness(run_dir: Path) -> dict[int, int]:
    """Staleness of every consumed sample, from the per-token versions the rollout recorded."""
    hist: dict[int, int] = {}
    for row in read_metrics(run_dir / "metrics.jsonl", "train"):
        for k, v in row["token_staleness_hist"].items():
            hist[int(k)] = hist.get(int(k), 0) + v
    return hist


@pytest.mark.integration
def test_tau1_bound_holds_and_services_are_processes(small_config, run_pipeline, tmp_path: Path) -> None:
    # With the KL term on (the default's full-vocabulary form), so the Reference is one of the processes; every
    # service in a process of its own (the default hosts the Reference, Evaluator and Reward with the Rollout), so
    # the default suite runs that layout too (test_cohost_faults.py checks the shared one).
    cfg = small_config(
        "staleness.tau=1",
        "trainer.total_steps=8",
        "data.tasks=[text, audio]",
        "algorithm.kl_coef=0.1",
        "run.hosts=[]",
    )
    assert cfg.algorithm.kl_estimator == "full"
    result = run_pipeline(cfg)
    assert result.steps == 8
    hist = _token_staleness(result.run_dir)
    assert sum(hist.values()) == 8 * cfg.samples_per_step
    assert max(hist) <= 1, hist  # the guarantee: no update consumes a sample staler than τ
    assert hist.get(1, 0) > 0, "τ = 1 never overlapped rollout and training"
    assert result.ledger["duplicated"] == 0 and result.ledger["unknown"] == 0
    assert result.ledger["consumed"] == 8 * cfg.trainer.groups_per_step
    # Every service had a process of its own, none of them the controller's, and none outlives the run.
    pids = result.service_pids
    assert set(pids) >= {"trainer", "rollout-0", "reward", "reference", "eval"}
    kls = [row["kl"] for row in read_metrics(result.run_dir / "metrics.jsonl", "train")]
    assert len(kls) == 8 and all(math.isfinite(k) and k >= 0 for k in kls), kls  # KL(ref ‖ π), the Trainer engine's own
    assert len(set(pids.values())) == len(pids) and os.getpid() not in pids.values()
    assert not _alive(pids.values(), wait_s=20.0)


def _alive(pids, wait_s: float) -> list[int]:
    """Pids still running (not zombies) after waiting up to ``wait_s`` seconds for them to exit."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(procs, timeout=wait_s)
    return [p.pid for p in alive if p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.slow
@pytest.mark.integration
def test_tau2_reward_rises_on_image_task(small_config, run_pipeline, tmp_path: Path) -> None:
    cfg = small_config(
        "staleness.tau=2",
        "trainer.total_steps=80",
        "trainer.target_reward=0.9",
        "trainer.groups_per_step=16",
        "trainer.micro_batch_groups=16",
        "rollout.groups_per_call=4",
        "algorithm.group_size=8",
        "trainer.warmup_format_steps=20",
        "data.tasks=[image]",
        "data.eval_per_task=16",
        "eval.every_steps=10",
    )
    result = run_pipeline(cfg)
    hist = _token_staleness(result.run_dir)
    assert max(hist) <= 2, hist
    evals = [row for row in read_metrics(result.run_dir / "metrics.jsonl", "eval")]
    first = next(row for row in evals if row["version"] == 0)["reward"]["image"]
    assert first <= 0.8  # the format warm-up teaches options, not answers: it starts near chance (0.5)
    assert result.final_eval["image"] >= 0.8, evals
    assert (result.run_dir / "reward.png").is_file() and (result.run_dir / "staleness.png").is_file()


@pytest.mark.slow  # ~100 s on 2 cores; the filter and the admission refund have unit tests in the default suite
@pytest.mark.integration
def test_filter_groups_trains_only_on_groups_with_signal(small_config, run_pipeline) -> None:
    # Before the format warm-up has taught much, most text groups score all zero: without handing their admission
    # back, batches consumed without an update would stall the producers at τ for good.
    cfg = small_config(
        "algorithm.filter_groups=true",
        "trainer.total_steps=2",
        "trainer.warmup_format_steps=2",
        "data.tasks=[image, text]",
    )
    result = run_pipeline(cfg)
    assert result.steps == 2
    metrics = list(read_metrics(result.run_dir / "metrics.jsonl"))
    filtered = [r for r in metrics if r["kind"] == "filtered"]
    train = [r for r in metrics if r["kind"] == "train"]
    assert filtered, "no batch was filtered out whole"
    assert all(0 <= r["filtered_rows"] < r["samples"] for r in train)
    ledger = result.ledger
    assert ledger["lost"] == 0 and ledger["duplicated"] == 0 and ledger["unknown"] == 0, ledger
    batches = len(train) + len(filtered)
    assert ledger["consumed"] == batches * cfg.trainer.groups_per_step, ledger
