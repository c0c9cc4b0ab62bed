"""The remote reward against small HTTP servers on 127.0.0.1: healthy, flaky, failing, refusing, down."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

import relax_core as rc


class Judge(ThreadingHTTPServer):
    """Scores exact match; ``fail_first`` replies fail with ``status`` first; tracks requests in flight."""

    daemon_threads = True

    def __init__(self, fail_first: int = 0, status: int = 500, hold_s: float = 0.0) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.fail_first = fail_first
        self.status = status
        self.hold_s = hold_s
        self.requests: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/score"


class Handler(BaseHTTPRequestHandler):
    server: Judge

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        judge = self.server
        with judge.lock:
            judge.requests.append(body)
            fail = len(judge.requests) <= judge.fail_first
            judge.in_flight += 1
            judge.max_in_flight = max(judge.max_in_flight, judge.in_flight)
        time.sleep(judge.hold_s)  # lets requests overlap, so the concurrency bound is exercised
        with judge.lock:
            judge.in_flight -= 1
        if fail:
            self.send_error(judge.status)
            return
        score = float(body["response"] == body["ground_truth"])
        reply = json.dumps({"score": score, "judge": "exact", "source": body["data_source"]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: Any) -> None:  # keep test output clean
        pass


def serve(judge: Judge) -> Iterator[Judge]:
    thread = threading.Thread(target=judge.serve_forever, daemon=True)
    thread.start()
    try:
        yield judge
    finally:
        judge.shutdown()
        judge.server_close()
        thread.join()


@pytest.fixture
def judge() -> Iterator[Judge]:
    yield from serve(Judge(hold_s=0.05))


def remote_runner(url: str, **remote: Any) -> rc.RewardRunner:
    cfg = rc.RewardRunnerConfig(
        default=rc.RewardSpec(fn="remote", remote=rc.RemoteRewardConfig(url=url, backoff_s=0.01, **remote)),
        fallback_score=-1.0,
    )
    return rc.build_reward_runner(cfg)


def test_remote_reward_scores_with_bounded_concurrency(judge: Judge) -> None:
    requests = [rc.RewardRequest(str(i % 3), "0", "geo", {"index": i}) for i in range(12)]
    with remote_runner(judge.url, max_concurrency=2) as runner:
        out = runner.score(requests)
    assert [o.score for o in out] == [1.0 if i % 3 == 0 else 0.0 for i in range(12)]
    assert out[0].details == {"judge": "exact", "source": "geo"}
    assert len(judge.requests) == 12 and judge.max_in_flight <= 2
    assert sorted(r["metadata"]["index"] for r in judge.requests) == list(range(12))


def test_remote_reward_retries_500s_then_succeeds() -> None:
    for judge in serve(Judge(fail_first=2, status=503)):
        with remote_runner(judge.url, retries=3, max_concurrency=1) as runner:
            out = runner.score([rc.RewardRequest("a", "a")])
            assert out[0].score == 1.0 and out[0].ok
            assert runner._owned[0].attempts == 3  # two 503s, then the answer


def test_remote_reward_that_keeps_failing_gets_the_fallback() -> None:
    for judge in serve(Judge(fail_first=10**6, status=500)):
        with remote_runner(judge.url, retries=2) as runner:
            out = runner.score([rc.RewardRequest("a", "a"), rc.RewardRequest("b", "b")])
        assert [o.score for o in out] == [-1.0, -1.0]
        assert all("3 attempts failed, last: HTTP 500" in (o.error or "") for o in out)
        assert len(judge.requests) == 6 and runner.stats.errors == 2
    for judge in serve(Judge(fail_first=10**6, status=400)):
        with remote_runner(judge.url, retries=2) as runner:
            out = runner.score([rc.RewardRequest("a", "a")])
        assert "HTTP 400" in (out[0].error or "") and "not retried" in (out[0].error or "")
        assert len(judge.requests) == 1


def test_remote_reward_with_the_server_down() -> None:
    with socket.socket() as s:  # a port that was free a moment ago and has nobody listening now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with remote_runner(f"http://127.0.0.1:{port}/score", retries=1) as runner:
        out = runner.score([rc.RewardRequest("a", "a")])
    assert out[0].score == -1.0
    assert "2 attempts failed" in (out[0].error or "") and "refused" in (out[0].error or "").lower()
    assert runner.stats.errors == 1 and runner._owned[0].attempts == 2
