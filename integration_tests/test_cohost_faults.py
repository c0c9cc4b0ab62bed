"""Roles sharing one process (``run.hosts``, the default run's Rollout + Evaluator + Reward; no Reference here, the
fast config has no KL term) over real Ray: they really run in one process, a raise in one of them rebuilds only that
one inside the host, a role that cannot be rebuilt there and a SIGKILL of the host (through the Evaluator)
bring every role it held back in one new process, the ledger exact (counted, never timed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax_services.reporting.metrics import read_metrics

HOSTED = ("rollout-0", "eval", "reward")


def _events(run_dir: Path) -> list[dict]:
    return list(read_metrics(run_dir / "metrics.jsonl", "health"))


def _assert_exact_ledger(result, steps: int, groups_per_step: int) -> None:
    ledger = result.ledger
    assert ledger["lost"] == 0 and ledger["duplicated"] == 0 and ledger["unknown"] == 0, ledger
    assert ledger["consumed"] == steps * groups_per_step, ledger


@pytest.mark.integration
def test_a_killed_host_brings_back_every_role_it_held(small_config, run_pipeline) -> None:
    # The kill lands once two updates' worth of samples wait for the trainer, so the outage overlaps queued work.
    cfg = small_config(
        "staleness.tau=4",
        "trainer.total_steps=30",
        "trainer.ppo_epochs=4",
        "data.tasks=[image, text]",
        # SIGKILL of the Evaluator's process: its host, with the Rollout and the Reward
        "faults=[{service: eval, kind: kill, at_step: 3, min_trainer_backlog: 32}]",
        "queue.lease_timeout_s=5",
    )
    result = run_pipeline(cfg)
    assert result.error is None and result.steps == 30, result.error
    events = _events(result.run_dir)
    injected = next(e for e in events if e["event"] == "injected")
    assert injected["service"] == "eval"
    detected = {e["service"] for e in events if e["event"] == "detected"}
    assert detected == set(HOSTED), events
    restarted = [e for e in events if e["event"] == "restarted"]
    assert sorted(e["service"] for e in restarted) == sorted(HOSTED), restarted
    assert {e["process"] for e in restarted} == {"new"} and len({e["pid"] for e in restarted}) == 1, restarted
    pids = result.service_pids  # every role is back, in the one new process
    assert pids["rollout-0"] == pids["eval"] == pids["reward"] == restarted[0]["pid"] != pids["trainer"], pids
    assert not [e for e in events if e["event"] == "global_restart"], events
    reward = _assert_host_replaced_once(events, pids)
    assert reward["restarts"] == 0  # the process died, not a role in it: only the host's count went up
    assert result.final_version == 30 and set(result.final_eval) == {"image", "text"}, result.final_eval
    _assert_exact_ledger(result, 30, cfg.trainer.groups_per_step)


def _assert_host_replaced_once(events: list[dict], pids: dict[str, int]) -> dict:
    """Every hosted role came back in one new process (the one each now reports), the Trainer untouched; returns
    that restart's event of the Reward."""
    replaced = [e for e in events if e["event"] == "restarted" and e["process"] == "new"]
    assert sorted(e["service"] for e in replaced) == sorted(HOSTED), replaced
    assert len({e["pid"] for e in replaced}) == 1 and {e["host_restarts"] for e in replaced} == {1}, replaced
    assert pids["rollout-0"] == pids["eval"] == pids["reward"] == replaced[0]["pid"] != pids["trainer"], pids
    assert not [e for e in events if e["event"] in ("global_restart", "gave_up")], events
    return next(e for e in replaced if e["service"] == "reward")


@pytest.mark.integration
@pytest.mark.slow  # an edge of the restart paths; out of the default suite for its 12-minute budget
def test_a_hosted_role_that_cannot_be_rebuilt_gets_its_host_replaced(small_config, run_pipeline) -> None:
    """The Evaluator raises (rebuilt in the host: its count 1 of ``health.max_restarts=1``), then the Reward breaks
    (its rebuild fails there): the host is replaced with every role, counted against the host and the Reward only, so
    the Evaluator is not spent and no global restart follows."""
    cfg = small_config(
        "staleness.tau=1",
        "trainer.total_steps=20",
        "data.tasks=[text]",
        "health.max_restarts=1",
        "queue.lease_timeout_s=5",
        "faults=[{service: eval, kind: raise, at_step: 3}, {service: reward, kind: break, at_step: 6}]",
    )
    assert cfg.run.hosts == [["rollout", "reference", "eval", "reward"]]  # the default
    result = run_pipeline(cfg)
    assert result.error is None and result.steps == 20, result.error
    events = _events(result.run_dir)
    first_pid = next(e for e in events if e["event"] == "restarted")["pid"]
    rebuilt = [(e["service"], e["process"], e["restarts"]) for e in events if e["event"] == "restarted"]
    # The raise: the Evaluator rebuilt alone, in the first host; then the three roles of the replaced host.
    assert rebuilt[0] == ("eval", "same", 1) and len(rebuilt) == 4, rebuilt
    unbuilt = [e for e in events if e["event"] == "detected" and "rebuild inside host" in str(e["reason"])]
    # The Reward's own failure, then its fellow roles' ("its host ... failed with reward: its rebuild ...").
    assert [e["service"] for e in unbuilt] == ["reward", "rollout-0", "eval"], events
    assert unbuilt[0]["reason"].startswith("its rebuild inside host"), unbuilt
    assert "injected fault 'break'" in unbuilt[0]["reason"], unbuilt
    reward = _assert_host_replaced_once(events, result.service_pids)
    assert reward["pid"] != first_pid and reward["restarts"] == 1, reward
    counts = {e["service"]: e["restarts"] for e in events if e["event"] == "restarted" and e["process"] == "new"}
    assert counts == {"rollout-0": 0, "eval": 1, "reward": 1}, counts
    # The Evaluator in the new process gave the final evaluation, of the last version.
    assert result.final_version == 20 and set(result.final_eval) == {"text"}, result.final_eval
    _assert_exact_ledger(result, 20, cfg.trainer.groups_per_step)
