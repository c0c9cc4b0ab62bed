"""Live scaling of the Rollout replicas during a run, through the driver's control endpoint (what ``relax scale``
sends): a scale-out whose replica is admitted only once it holds the Trainer's version and then feeds the Trainer,
a scale-in that drains it, bad requests answered with an error, and a finished run that says it is not running;
a replica killed while it joins, rolled back and joined again; and the autoscaler adding a replica while the Trainer
waits. The ledger stays exact and τ holds throughout."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from relax_services.control.controller import Controller
from relax_services.control.endpoint import CONTROL_FILE, EndpointError, send_request
from relax_services.reporting.metrics import read_metrics

TAU = 1


def _records(run_dir: Path, kind: str) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return list(read_metrics(path, kind)) if path.exists() else []


def _until(check, what: str, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")
        time.sleep(0.25)


def _fed_by(run_dir: Path, replica: str) -> int:
    return sum(r["samples_by_replica"].get(replica, 0) for r in _records(run_dir, "train"))


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("sync", ["object_store", "broadcast"])
def test_scale_out_then_in_during_a_run(small_config, ray_session, sync: str) -> None:
    # broadcast: the new replica registers its slot and joins the group at the next version; the removed one leaves it
    cfg = small_config(
        f"trainer.weight_sync={sync}",
        f"staleness.tau={TAU}",
        "trainer.total_steps=100000",  # the test ends the run once it has scaled out and in
        "trainer.max_minutes=6",  # a safety net only
        "data.tasks=[text]",
        "rollout.groups_per_call=1",
    )
    run_dir = cfg.run.output_dir / "run"
    run_dir.mkdir(parents=True)
    controller = Controller(cfg, run_dir)
    answers: dict[str, object] = {}

    def drive() -> None:
        try:
            _until(lambda: (run_dir / CONTROL_FILE).exists() and _records(run_dir, "train"), "the first update")
            with pytest.raises(EndpointError, match="a run keeps at least 1 rollout replica"):
                send_request(run_dir, {"op": "scale", "role": "rollout", "count": 0})
            with pytest.raises(EndpointError, match="only the rollout role scales"):
                send_request(run_dir, {"op": "scale", "role": "trainer", "count": 2})
            answers["out"] = send_request(run_dir, {"op": "scale", "role": "rollout", "count": 2})
            _until(lambda: _fed_by(run_dir, "rollout-1") >= 2 * cfg.algorithm.group_size, "rollout-1's samples")
            answers["in"] = send_request(run_dir, {"op": "scale", "role": "rollout", "count": 1})
            steps = max(r["step"] for r in _records(run_dir, "train"))
            _until(lambda: max(r["step"] for r in _records(run_dir, "train")) >= steps + 2, "updates after scale-in")
        except BaseException as exc:  # reported by the test's thread below
            answers["error"] = exc
        finally:
            controller.request_stop("the test scaled out and in")

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    result = controller.run()
    driver.join(timeout=60)
    assert "error" not in answers, answers.get("error")
    assert result.error is None, result.error
    assert answers["out"]["from"] == 1 and answers["out"]["to"] == 2 and answers["out"]["added"] == ["rollout-1"]
    assert answers["in"]["to"] == 1 and answers["in"]["removed"] == ["rollout-1"]

    # Every transition is a `scale` record, in this order.
    scale = _records(run_dir, "scale")
    events = [(r["event"], r.get("replica")) for r in scale]
    assert events == [
        ("requested", None),
        ("join_started", "rollout-1"),
        ("joined", "rollout-1"),
        ("done", None),
        ("requested", None),
        ("drain_started", "rollout-1"),
        ("removed", "rollout-1"),
        ("done", None),
    ], events
    joined = next(r for r in scale if r["event"] == "joined")
    assert joined["version"] >= next(r for r in scale if r["event"] == "join_started")["version"]
    assert next(r for r in scale if r["event"] == "removed")["drained"] is True

    # The new replica never generated with weights older than those it was admitted with, and nothing of it came
    # after its removal (its last records are collected while it drains).
    lines = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] in ("rollout", "scale")]
    own = [i for i, r in enumerate(lines) if r["kind"] == "rollout" and r["service"] == "rollout-1"]
    removed_at = next(i for i, r in enumerate(lines) if r["kind"] == "scale" and r["event"] == "removed")
    assert own and max(own) < removed_at, (own, removed_at)
    assert min(lines[i]["version"] for i in own) >= joined["version"]

    trains = _records(run_dir, "train")
    by_replica: Counter[str] = Counter()
    staleness: Counter[int] = Counter()
    for record in trains:
        by_replica.update(record["samples_by_replica"])
        staleness.update({int(k): v for k, v in record["token_staleness_hist"].items()})
    assert set(by_replica) == {"rollout-0", "rollout-1"} and by_replica["rollout-1"] > 0, by_replica
    assert sum(by_replica.values()) == result.steps * cfg.samples_per_step, by_replica
    assert max(staleness) <= TAU, staleness
    ledger = result.ledger
    assert ledger["lost"] == 0 and ledger["duplicated"] == 0 and ledger["unknown"] == 0, ledger
    assert ledger["consumed"] == result.steps * cfg.trainer.groups_per_step, ledger
    assert "rollout-1" not in result.service_pids  # removed for good

    # The finished run: its endpoint is gone, and it says so.
    assert not (run_dir / CONTROL_FILE).exists()
    with pytest.raises(EndpointError, match="is not running"):
        send_request(run_dir, {"op": "scale", "role": "rollout", "count": 2})


@pytest.mark.integration
@pytest.mark.slow
def test_autoscaling_adds_a_replica_while_the_trainer_waits(small_config, ray_session) -> None:
    """A rollout-bound run (the Trainer waits for samples most of its time) with ``rollout.autoscale`` on: the
    autoscaler adds a replica through the same join as ``relax scale``, and it feeds the Trainer."""
    cfg = small_config(
        f"staleness.tau={TAU}",
        "trainer.total_steps=100000",
        "trainer.max_minutes=6",
        "data.tasks=[text]",
        "rollout.groups_per_call=1",
        "rollout.max_new_tokens=16",  # longer responses: rollout is the slower side
        "rollout.autoscale={enabled: true, min: 1, max: 2, window: 4, up_wait_frac: 0.2, cooldown_s: 0}",
    )
    run_dir = cfg.run.output_dir / "run"
    run_dir.mkdir(parents=True)
    controller = Controller(cfg, run_dir)
    failure: list[BaseException] = []

    def watch() -> None:
        try:
            _until(lambda: _fed_by(run_dir, "rollout-1") > 0, "an autoscaled replica's samples")
        except BaseException as exc:
            failure.append(exc)
        finally:
            controller.request_stop("the autoscaler added a replica")

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    result = controller.run()
    watcher.join(timeout=60)
    assert not failure, failure
    assert result.error is None, result.error
    scale = _records(run_dir, "scale")
    requested = next(r for r in scale if r["event"] == "requested")
    assert requested["reason"].startswith("autoscale: trainer wait ") and requested["count"] == 2, requested
    wait_share = float(requested["reason"].split("trainer wait ")[1].split(",")[0])
    assert wait_share > 0.2, requested  # the rule: above up_wait_frac over a full window
    assert [r["event"] for r in scale][:4] == ["requested", "join_started", "joined", "done"], scale
    ledger = result.ledger
    assert ledger["lost"] == 0 and ledger["duplicated"] == 0 and ledger["unknown"] == 0, ledger
    assert ledger["consumed"] == result.steps * cfg.trainer.groups_per_step, ledger


@pytest.mark.integration
@pytest.mark.slow
def test_a_replica_killed_while_joining_is_rolled_back_and_a_retry_joins(small_config, ray_session) -> None:
    """SIGKILL-equivalent of the new replica's process while it builds itself: the request is answered that the join
    failed and was rolled back (the replica never took a prompt), the run goes on, the same request again joins a
    replica that serves only weights at least as new as those it was admitted with, and the ledger stays exact."""
    import ray

    cfg = small_config(
        f"staleness.tau={TAU}", "trainer.total_steps=100000", "trainer.max_minutes=6", "data.tasks=[text]"
    )
    run_dir = cfg.run.output_dir / "run"
    run_dir.mkdir(parents=True)
    controller = Controller(cfg, run_dir)
    answers: dict[str, object] = {}

    def kill_when_joining() -> None:
        _until(lambda: any(r["event"] == "join_started" for r in _records(run_dir, "scale")), "the join to start")
        name = f"{controller.pipeline.namespace}-rollout-1-0"
        _until(lambda: _named(name) is not None, "the joining replica's actor")
        ray.kill(_named(name), no_restart=True)

    def drive() -> None:
        try:
            _until(lambda: (run_dir / CONTROL_FILE).exists() and _records(run_dir, "train"), "the first update")
            killer = threading.Thread(target=kill_when_joining, daemon=True)
            killer.start()
            try:
                send_request(run_dir, {"op": "scale", "role": "rollout", "count": 2})
            except EndpointError as exc:
                answers["failed"] = str(exc)
            killer.join(timeout=60)
            answers["retry"] = send_request(run_dir, {"op": "scale", "role": "rollout", "count": 2})
            _until(lambda: _fed_by(run_dir, "rollout-1") > 0, "the retried replica's samples")
        except BaseException as exc:
            answers["error"] = exc
        finally:
            controller.request_stop("the test killed a joining replica and joined another")

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    result = controller.run()
    driver.join(timeout=60)
    assert "error" not in answers, answers.get("error")
    assert result.error is None, result.error
    assert "replica rollout-1 failed to join" in str(answers["failed"]) and "rolled back" in str(answers["failed"])
    assert answers["retry"]["added"] == ["rollout-1"]
    events = [r["event"] for r in _records(run_dir, "scale")]
    assert events[:3] == ["requested", "join_started", "join_failed"], events
    assert events[3:7] == ["requested", "join_started", "joined", "done"], events
    joined = next(r for r in _records(run_dir, "scale") if r["event"] == "joined")
    own = [r for r in _records(run_dir, "rollout") if r["service"] == "rollout-1"]
    assert own and min(r["version"] for r in own) >= joined["version"]
    ledger = result.ledger
    assert ledger["lost"] == 0 and ledger["duplicated"] == 0 and ledger["unknown"] == 0, ledger
    assert ledger["consumed"] == result.steps * cfg.trainer.groups_per_step, ledger


def _named(name: str) -> object | None:
    """The live Ray actor of that name, or None."""
    import ray

    try:
        return ray.get_actor(name)
    except ValueError:
        return None
