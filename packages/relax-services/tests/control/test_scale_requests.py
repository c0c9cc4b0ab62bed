"""``relax scale``'s channel and its refusals, without a run: the driver's endpoint is an owner-only Unix socket
named in ``control.json`` that hands each request to the controller's loop and returns its answer; a finished run,
a driver that is gone, a count below 1, another role and a colocated run are each answered with a clear error."""

from __future__ import annotations

import json
import stat
import threading
from pathlib import Path

import pytest

from relax_services.cli import main
from relax_services.config import load_run_config
from relax_services.control.endpoint import CONTROL_FILE, ControlEndpoint, EndpointError, send_request
from relax_services.control.scaling import ReplicaScaling, ScaleError


def _answer_next(endpoint: ControlEndpoint, answer: dict[str, object], seen: list[dict[str, object]]) -> None:
    """The controller's side: wait for the next request, record it, answer it."""
    while (pending := endpoint.pending()) is None:
        threading.Event().wait(0.01)
    seen.append(pending.request)
    pending.reply(answer)


def _serve_once(endpoint: ControlEndpoint, answer: dict[str, object]) -> tuple[threading.Thread, list]:
    seen: list[dict[str, object]] = []
    thread = threading.Thread(target=_answer_next, args=(endpoint, answer, seen), daemon=True)
    thread.start()
    return thread, seen


def test_the_endpoint_is_the_owners_and_carries_requests_to_the_loop(tmp_path: Path) -> None:
    endpoint = ControlEndpoint(tmp_path)
    try:
        info = json.loads((tmp_path / CONTROL_FILE).read_text())
        sock = Path(info["socket"])
        assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700 and stat.S_IMODE(sock.stat().st_mode) == 0o600
        assert stat.S_ISSOCK(sock.stat().st_mode)
        thread, seen = _serve_once(endpoint, {"ok": True, "to": 3})
        assert send_request(tmp_path, {"op": "scale", "role": "rollout", "count": 3}, timeout_s=30) == {
            "ok": True,
            "to": 3,
        }
        thread.join(5)
        assert seen == [{"op": "scale", "role": "rollout", "count": 3}]
        thread, _ = _serve_once(endpoint, {"error": "rollout=0: a run keeps at least 1 rollout replica"})
        with pytest.raises(EndpointError, match=r"^rollout=0: a run keeps at least 1 rollout replica$"):
            send_request(tmp_path, {"op": "scale", "role": "rollout", "count": 0}, timeout_s=30)
        thread.join(5)
    finally:
        endpoint.close()
    assert not (tmp_path / CONTROL_FILE).exists() and not sock.parent.exists()
    with pytest.raises(EndpointError, match=r"is not running \(no control.json: it finished"):
        send_request(tmp_path, {"op": "scale", "role": "rollout", "count": 2})
    (tmp_path / CONTROL_FILE).write_text(json.dumps({"socket": str(sock), "pid": 4242}))  # a driver killed outright
    with pytest.raises(EndpointError, match=r"is not running \(its driver, pid 4242, is gone"):
        send_request(tmp_path, {"op": "scale", "role": "rollout", "count": 2})


def test_relax_scale_refuses_bad_counts_other_roles_colocated_and_finished_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("run:\n  mode: distributed\n")
    cases = [
        ("rollout=0", "rollout=0: a run keeps at least 1 rollout replica"),
        ("rollout=two", "rollout='two': the count is a whole number"),
        ("trainer=2", "expected rollout=N (the rollout replicas to run), got 'trainer=2'"),
        ("rollout=2", f"the run in {run} is not running (no control.json"),
    ]
    for change, message in cases:
        assert main(["scale", str(run), change]) == 2
        assert message in capsys.readouterr().err, change
    (run / "config.yaml").write_text("run:\n  mode: colocated\n")
    assert main(["scale", str(run), "rollout=2"]) == 2
    assert "is in colocated mode (every service a thread of one process): its rollout cannot scale" in (
        capsys.readouterr().err
    )


def test_relax_scale_prints_what_the_driver_did(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    endpoint = ControlEndpoint(tmp_path)
    try:
        answer = {"ok": True, "from": 1, "to": 3, "seconds": 12.5, "added": ["rollout-1", "rollout-2"], "removed": []}
        thread, seen = _serve_once(endpoint, answer)
        assert main(["scale", str(tmp_path), "rollout=3"]) == 0
        thread.join(5)
    finally:
        endpoint.close()
    assert seen == [{"op": "scale", "role": "rollout", "count": 3}]
    assert "relax scale: rollout 1 -> 3 in 12.5 s (added rollout-1, rollout-2)" in capsys.readouterr().out


class _Driver(ReplicaScaling):
    """The scaling part alone, over a config (no pipeline: every refusal below comes before one is touched)."""

    def __init__(self, *overrides: str) -> None:
        self.cfg = load_run_config(None, list(overrides))
        self._stop_reason = None


def test_the_driver_refuses_colocated_runs_and_counts_out_of_bounds() -> None:
    with pytest.raises(ScaleError, match=r"colocated mode .* its rollout cannot scale; run with run\.mode=distributed"):
        _Driver("run.mode=colocated").scale_rollout(2, reason="test")
    with pytest.raises(ScaleError, match=r"rollout=0: a run keeps at least 1 rollout replica"):
        _Driver().scale_rollout(0, reason="test")
    with pytest.raises(ScaleError, match=r"rollout=65: at most 64 rollout replicas"):
        _Driver().scale_rollout(65, reason="test")
