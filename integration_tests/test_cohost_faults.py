"""Roles sharing one process (``run.hosts``, the default run's Rollout + Evaluator + Reward; no Reference here, the
fast config has no KL term) over real Ray: they really run in one process, a raise in one of them rebuilds only that
one inside the host, and a SIGKILL of the host brings every role it held back in one new process, the ledger exact
(counted, never timed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax_services._metrics import read_metrics

HOSTED = ("rollout-0", "eval", "reward")


def _events(run_dir: Path) -> list[dict]:
    return list(read_metrics(run_dir / "metrics.jsonl", "health"))


def _assert_exact_ledger(result, steps: int, groups_per_step: int) -> None:
    ledger = result.ledger
    assert ledger["lost"] == 0 and ledger["duplicated"] == 0 and ledger["unknown"] == 0, ledger
    assert ledger["consumed"] == steps * groups_per_step, ledger


@pytest.mark.integration
def test_a_raise_in_one_hosted_role_rebuilds_only_that_role(small_config, run_pipeline) -> None:
    cfg = small_config(
        "staleness.tau=1",
        "trainer.total_steps=20",
        "data.tasks=[text]",
        "faults=[{service: reward, kind: raise, at_step: 3}]",
    )
    assert cfg.run.hosts == [["rollout", "reference", "eval", "reward"]]  # the default
    result = run_pipeline(cfg)
    assert result.error is None and result.steps == 20, result.error
    pids = result.service_pids
    assert pids["rollout-0"] == pids["eval"] == pids["reward"] != pids["trainer"], pids
    events = _events(result.run_dir)
    restarted = [e for e in events if e["event"] == "restarted"]
    assert [(e["service"], e["process"], e["pid"]) for e in restarted] == [("reward", "same", pids["reward"])]
    assert not [e for e in events if e["event"] == "global_restart"], events
    _assert_exact_ledger(result, 20, cfg.trainer.groups_per_step)


@pytest.mark.integration
def test_a_killed_host_brings_back_every_role_it_held(small_config, run_pipeline) -> None:
    # The kill lands once two updates' worth of samples wait for the trainer, so the outage overlaps queued work.
    cfg = small_config(
        "staleness.tau=4",
        "trainer.total_steps=30",
        "trainer.ppo_epochs=4",
        "data.tasks=[image, text]",
        "faults=[{service: reward, kind: kill, at_step: 3, min_trainer_backlog: 32}]",  # SIGKILL of its host
        "queue.lease_timeout_s=5",
    )
    result = run_pipeline(cfg)
    assert result.error is None and result.steps == 30, result.error
    events = _events(result.run_dir)
    injected = next(e for e in events if e["event"] == "injected")
    assert injected["service"] == "reward"
    detected = {e["service"] for e in events if e["event"] == "detected"}
    assert detected == set(HOSTED), events
    restarted = [e for e in events if e["event"] == "restarted"]
    assert sorted(e["service"] for e in restarted) == sorted(HOSTED), restarted
    assert {e["process"] for e in restarted} == {"new"} and len({e["pid"] for e in restarted}) == 1, restarted
    pids = result.service_pids  # every role is back, in the one new process
    assert pids["rollout-0"] == pids["eval"] == pids["reward"] == restarted[0]["pid"] != pids["trainer"], pids
    assert not [e for e in events if e["event"] == "global_restart"], events
    _assert_exact_ledger(result, 30, cfg.trainer.groups_per_step)
