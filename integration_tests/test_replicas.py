"""Rollout replicas: several Rollout workers, each in a process of its own, pulling from the one prompt queue.

Two replicas from the start on the default tiny model: both produce samples that updates consume (counted per
replica from the ``train`` records, which name the replica of every sample), the ledger is exact and no update
consumes a sample staler than τ."""

from __future__ import annotations

from collections import Counter

import pytest

from relax_services.reporting.metrics import read_metrics


@pytest.mark.integration
def test_two_replicas_both_feed_the_trainer_exactly_and_within_tau(small_config, run_pipeline) -> None:
    steps, tau = 6, 1
    cfg = small_config(
        "rollout.replicas=2",
        f"staleness.tau={tau}",
        f"trainer.total_steps={steps}",
        "data.tasks=[text]",
        "rollout.groups_per_call=1",  # one group per call: the two replicas interleave on the prompt queue
    )
    result = run_pipeline(cfg)
    assert result.error is None and result.steps == steps, result.error
    pids = result.service_pids
    # rollout-0 shares the default host (Reward, Evaluator); rollout-1 has a process of its own, not the Trainer's.
    assert pids["rollout-0"] == pids["eval"] != pids["rollout-1"] != pids["trainer"], pids

    trains = list(read_metrics(result.run_dir / "metrics.jsonl", "train"))
    by_replica: Counter[str] = Counter()
    for record in trains:
        by_replica.update(record["samples_by_replica"])
    group = cfg.algorithm.group_size
    # Every consumed sample came from one of the two replicas, both contributed, in whole groups.
    assert set(by_replica) == {"rollout-0", "rollout-1"}, by_replica
    assert sum(by_replica.values()) == steps * cfg.samples_per_step, by_replica
    assert all(n > 0 and n % group == 0 for n in by_replica.values()), by_replica
    # The rollout records agree: each replica generated at least what the trainer consumed from it.
    generated: Counter[str] = Counter()
    for record in read_metrics(result.run_dir / "metrics.jsonl", "rollout"):
        generated[record["service"]] += record["samples"]
    assert all(generated[name] >= n for name, n in by_replica.items()), (generated, by_replica)

    staleness: Counter[int] = Counter()
    for record in trains:
        staleness.update({int(k): v for k, v in record["token_staleness_hist"].items()})
    assert max(staleness) <= tau, staleness  # the guarantee, from the per-token versions the replicas recorded
    ledger = result.ledger
    assert ledger["lost"] == 0 and ledger["duplicated"] == 0 and ledger["unknown"] == 0, ledger
    assert ledger["consumed"] == steps * cfg.trainer.groups_per_step, ledger


@pytest.mark.integration
@pytest.mark.slow
def test_a_killed_replica_is_restarted_under_its_own_name(small_config, run_pipeline) -> None:
    """SIGKILL of rollout-1's process: the health manager brings back rollout-1 alone, in a new process, counted
    against rollout-1; rollout-0 (in the default host) keeps its process and count, and the ledger stays exact."""
    steps = 12
    cfg = small_config(
        "rollout.replicas=2",
        "staleness.tau=2",
        f"trainer.total_steps={steps}",
        "data.tasks=[text]",
        "rollout.groups_per_call=1",
        "faults=[{service: rollout, replica: 1, kind: kill, at_step: 2}]",
        "queue.lease_timeout_s=5",
    )
    result = run_pipeline(cfg)
    assert result.error is None and result.steps == steps, result.error
    events = list(read_metrics(result.run_dir / "metrics.jsonl", "health"))
    injected = [e for e in events if e["event"] == "injected"]
    restarted = [e for e in events if e["event"] == "restarted"]
    assert [e["service"] for e in injected] == ["rollout-1"], injected
    assert [(e["service"], e["process"], e["restarts"]) for e in restarted] == [("rollout-1", "new", 1)], restarted
    assert result.service_pids["rollout-1"] == restarted[0]["pid"] != result.service_pids["rollout-0"]
    assert not [e for e in events if e["event"] in ("global_restart", "gave_up")], events
    ledger = result.ledger
    assert ledger["lost"] == 0 and ledger["duplicated"] == 0 and ledger["unknown"] == 0, ledger
    assert ledger["consumed"] == steps * cfg.trainer.groups_per_step, ledger
