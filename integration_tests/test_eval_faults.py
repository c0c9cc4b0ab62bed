"""Faults on the Evaluator (``service: eval``) where it has no process of its own to lose: the colocated mode (every
role a thread of one process; the distributed cases are in ``test_cohost_faults.py``). The Evaluator makes no training
data, so its restart leaves the ledger exact and the run's updates untouched, and evaluation goes on after it
(counted, never timed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax_services.control.colocated import ColocatedController
from relax_services.reporting.metrics import read_metrics


@pytest.mark.integration
def test_a_raise_in_the_colocated_evaluator_rebuilds_it_alone(small_config, tmp_path: Path) -> None:
    steps = 6
    cfg = small_config(
        "run.mode=colocated",
        "staleness.tau=2",
        f"trainer.total_steps={steps}",
        "data.tasks=[text]",
        # at step 0: before the first update, so the run cannot end before the fault lands (six updates take a
        # fraction of a second in one process)
        "faults=[{service: eval, kind: raise, at_step: 0}]",
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    result = ColocatedController(cfg, run_dir).run()
    assert result.error is None and result.steps == steps, result.error
    events = list(read_metrics(run_dir / "metrics.jsonl", "health"))
    detected = [(e["service"], e["reason"]) for e in events if e["event"] == "detected"]
    assert detected == [("eval", "work loop raised: RuntimeError: injected fault in eval")], events
    restarted = [(e["service"], e["process"], e["restarts"]) for e in events if e["event"] == "restarted"]
    assert restarted == [("eval", "same", 1)], events
    assert not [e for e in events if e["event"] == "global_restart"], events
    assert result.final_version == steps and set(result.final_eval) == {"text"}, result.final_eval
    ledger = result.ledger
    assert ledger["lost"] == 0 and ledger["duplicated"] == 0 and ledger["consumed"] == steps * 4, ledger
