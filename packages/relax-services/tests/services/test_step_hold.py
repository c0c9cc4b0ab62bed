"""The Trainer's hold between updates (``services/_hold.py``): a checkpoint request returns only once the loop is at
a step boundary reached after the request, and a release never leaves a mark that satisfies the next request."""

from __future__ import annotations

import threading

import pytest

from relax_services.services._hold import StepHold


def _request_in_thread(hold: StepHold) -> tuple[threading.Thread, list[BaseException | None]]:
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            hold.request(timeout=60.0)
            outcome.append(None)
        except BaseException as exc:  # reported to the test thread
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def _wait_requested(hold: StepHold) -> None:
    while not hold.requested:  # the request thread sets it first thing; no timing is asserted
        threading.Event().wait(0.001)


def test_a_request_returns_once_the_loop_reaches_a_boundary() -> None:
    hold = StepHold()
    assert hold.at_boundary() is False  # nothing asked: the loop goes on
    thread, outcome = _request_in_thread(hold)
    _wait_requested(hold)
    assert not hold.held and thread.is_alive()  # the loop has not reached a boundary since the request
    assert hold.at_boundary() is True
    thread.join()
    assert outcome == [None] and hold.held
    assert hold.at_boundary() is True  # still held until the release
    hold.release()
    assert hold.at_boundary() is False and not hold.held


def test_a_mark_from_an_earlier_hold_does_not_satisfy_the_next_request() -> None:
    """The defect: the loop saw a request, the controller released it, then the loop marked itself held; the next
    request returned at once while the loop trained. Here the mark of the first hold is there when the second
    request comes (no release in between), and that request must still wait for a boundary of its own."""
    hold = StepHold()
    thread, outcome = _request_in_thread(hold)
    _wait_requested(hold)
    hold.at_boundary()
    thread.join()
    assert outcome == [None] and hold.held
    with pytest.raises(TimeoutError, match="step boundary"):
        hold.request(timeout=0.01)  # no boundary since this request: it cannot be satisfied
    hold.release()
    assert not hold.requested and hold.at_boundary() is False


def test_a_loop_never_trains_while_a_request_has_returned() -> None:
    """A loop thread between boundaries, a controller asking and releasing many times: whenever a request has
    returned, the loop is at a boundary (it starts no update until the release)."""
    hold = StepHold()
    stop = threading.Event()
    training = threading.Event()
    violations: list[int] = []

    def loop() -> None:
        while not stop.is_set():
            if hold.at_boundary():
                continue
            training.set()
            training.clear()

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        for i in range(300):
            hold.request(timeout=60.0)
            if training.is_set():
                violations.append(i)
            hold.release()
    finally:
        stop.set()
        thread.join()
    assert violations == []
