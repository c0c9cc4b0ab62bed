"""The run's actors that are not services — the queues, the weight store, the health monitor — die as Ray's memory
monitor ends them (SIGKILL of their process), mid-run and in the middle of the global restart that follows: the run
comes back from its last checkpoint with an exact ledger; when it may not restart any more it ends with a message
that says what died, what was kept and how to resume, and the resumed run finishes."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax_services.bench.chaos import fault_table
from relax_services.config import FaultSpec
from relax_services.control.controller import Controller
from relax_services.reporting.metrics import read_metrics


def _health(run_dir: Path) -> list[dict]:
    return list(read_metrics(run_dir / "metrics.jsonl", "health"))


@pytest.mark.integration
def test_queue_killed_mid_run_and_monitor_killed_during_the_restart(small_config, run_pipeline) -> None:
    cfg = small_config(
        "staleness.tau=1",
        "trainer.total_steps=40",  # tiny text updates take ~0.05 s: room for the fault to land mid-run
        "trainer.checkpoint_every=2",
        "data.tasks=[text]",
        "faults=[{service: sample_queue, kind: kill, at_step: 3},"
        " {service: health_monitor, kind: kill, at_step: 3, during_restart: true}]",
    )
    result = run_pipeline(cfg)
    assert result.error is None, result.error
    assert result.stop_reason == "total_steps reached" and result.steps == 40
    # Exact ledger, read from the final checkpoint and its queue snapshots: each of the 40 updates consumed its 4
    # groups once, and no prompt went missing across the two deaths.
    assert result.ledger["lost"] == 0 and result.ledger["duplicated"] == 0, result.ledger
    assert result.ledger["consumed"] == 40 * cfg.trainer.groups_per_step, result.ledger
    events = _health(result.run_dir)
    seq = [(e["event"], e["service"]) for e in events if e["event"] != "restored"]
    queue_kill = seq.index(("injected", "sample_queue"))
    # The queue's death is detected and answered with a global restart; in that restart the monitor is killed,
    # which is detected too, and a second attempt brings the run back.
    expected = [
        ("detected", "sample_queue"),
        ("global_restart", "run"),
        ("injected", "health_monitor"),
        ("detected", "health_monitor"),
        ("global_restart", "run"),
        ("recovered", "run"),
    ]
    after = [k for k in seq[queue_kill + 1 :] if k in expected]
    assert after[: len(expected)] == expected, seq
    detected = [e for e in events if e["event"] == "detected"]
    assert "sample queue" in detected[0]["reason"] or "SIGKILL" in detected[0]["reason"], detected[0]
    restarts = [e for e in events if e["event"] == "global_restart"]
    assert restarts[1]["reason"].startswith("global restart interrupted: the health monitor actor"), restarts[1]
    # The interrupted attempt names the services that came up before the death was acted on (a subset of the run's).
    assert set(restarts[1]["services_started"]) <= set(result.service_pids), restarts[1]
    table = fault_table(result.health_events, result.ledger)
    assert "all recovered: yes" in table.splitlines()[-1], table


@pytest.mark.integration
@pytest.mark.slow  # out of the default suite for its 12-minute budget
def test_a_death_past_the_restart_allowance_ends_clearly_and_resumes(small_config, run_pipeline) -> None:
    cfg = small_config(
        "staleness.tau=1",
        "trainer.total_steps=60",  # tiny text updates take ~0.05 s: room for the fault to land mid-run
        "trainer.checkpoint_every=2",
        "data.tasks=[text]",
        "health.max_global_restarts=0",
        # The second fault is not reached before the first ends the run: the resumed run injects it, not the first.
        "faults=[{service: prompt_queue, kind: kill, at_step: 3}, {service: reward, kind: kill, at_step: 55}]",
    )
    result = run_pipeline(cfg)  # returns: no exception escapes the controller
    assert result.stop_reason == "gave up"
    error = result.error or ""
    assert "the prompt queue actor (prompt_queue) died" in error, error
    assert "SIGKILL" in error and "health.max_global_restarts=0" in error, error
    assert "kept: the checkpoint of step" in error and "--resume" in error, error
    assert f"run.name={result.run_dir.name}" in error, error
    summary = list(read_metrics(result.run_dir / "metrics.jsonl", "summary"))
    assert summary and summary[-1]["error"] == error  # the run's record is complete
    assert result.ledger["lost"] == 0 and result.ledger["duplicated"] == 0, result.ledger
    kept = int(error.split("kept: the checkpoint of step ")[1].split()[0])
    assert 2 <= kept < 60  # a checkpoint after step 2 (the fault came at step 3 or later) and before the end

    # The message's way on: --resume from what was kept (same config, faults included) finishes the run, the
    # ledger exact across both parts. The fault the earlier run injected is not injected again (it would end the
    # resumed run the same way); the one it never reached is.
    resumed = Controller(cfg, result.run_dir, resume=True).run()
    assert resumed.error is None and resumed.stop_reason == "total_steps reached" and resumed.steps == 60
    assert resumed.ledger["lost"] == 0 and resumed.ledger["duplicated"] == 0, resumed.ledger
    assert resumed.ledger["consumed"] == 60 * cfg.trainer.groups_per_step, resumed.ledger
    injected = [e for e in _health(result.run_dir) if e["event"] == "injected"]
    assert [e["fault_index"] for e in injected] == [0, 1], injected


class _QueueDiesAtStart(Controller):
    """The sample queue is SIGKILLed at the end of the run's very first start, before any update."""

    killed = False

    def _start_pipeline(self, restore: Path | None) -> None:
        super()._start_pipeline(restore)
        if not self.killed:
            self.killed = True
            self._kill_actor(FaultSpec(service="sample_queue", kind="kill"))
            self.watch.check()


@pytest.mark.integration
@pytest.mark.slow  # an edge of the restart paths; out of the default suite for its 12-minute budget
def test_a_queue_that_dies_during_the_first_start_is_a_global_restart(small_config) -> None:
    cfg = small_config("staleness.tau=1", "trainer.total_steps=6", "trainer.checkpoint_every=2", "data.tasks=[text]")
    run_dir = cfg.run.output_dir / "run"
    run_dir.mkdir(parents=True)
    result = _QueueDiesAtStart(cfg, run_dir).run()
    assert result.error is None and result.stop_reason == "total_steps reached" and result.steps == 6
    assert result.ledger["lost"] == 0 and result.ledger["duplicated"] == 0, result.ledger
    assert result.ledger["consumed"] == 6 * cfg.trainer.groups_per_step, result.ledger
    seq = [(e["event"], e["service"]) for e in _health(run_dir)]
    assert seq[:4] == [
        ("injected", "sample_queue"),
        ("detected", "sample_queue"),
        ("global_restart", "run"),
        ("restored", "run"),  # from the step-0 checkpoint the first start wrote
    ], seq
