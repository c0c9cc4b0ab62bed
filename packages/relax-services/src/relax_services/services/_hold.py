"""The Trainer's hold between updates: what a consistent checkpoint waits for.

The controller asks for a hold (:meth:`StepHold.request`) and writes the checkpoint once the Trainer's loop is at a
step boundary; :meth:`StepHold.release` lets the loop go on. The loop's "is a hold asked for?" check and its
"I am held" mark are one step under one lock, and a release clears both under the same lock. With the check and
the mark as two separate events, a release landing between them (the loop saw the request, the controller released,
then the loop marked itself held) left a stale mark behind: the next request returned at once while the loop went
on training, and the checkpoint read weights and optimizer moments in the middle of an update.
"""

from __future__ import annotations

import threading

__all__ = ["StepHold"]


class StepHold:
    """A hold request from a controller, honoured by a work loop at its step boundaries."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._requested = False
        self._held = False

    def request(self, timeout: float) -> None:
        """Ask for a hold and wait until the loop is held at a boundary reached after this request.

        Raises:
            TimeoutError: the loop reached no step boundary within ``timeout`` seconds (the request stays, so a loop
                that comes back holds at its next boundary).
        """
        with self._cond:
            self._requested = True
            self._held = False  # only a boundary reached from now on counts
            if not self._cond.wait_for(lambda: self._held, timeout):
                raise TimeoutError(f"trainer did not reach a step boundary within {timeout}s")

    def release(self) -> None:
        """End the hold: the loop goes on at its next boundary (also ends a request that timed out)."""
        with self._cond:
            self._requested = False
            self._held = False

    def at_boundary(self) -> bool:
        """Called by the loop between updates: True (and marked held) when a hold is asked for, then the loop
        must not start an update; False otherwise."""
        with self._cond:
            if self._requested:
                self._held = True
                self._cond.notify_all()
            return self._requested

    @property
    def requested(self) -> bool:
        """Whether a hold is asked for (the loop re-checks it after a wait, before starting an update)."""
        with self._cond:
            return self._requested

    @property
    def held(self) -> bool:
        """Whether the loop is held at a boundary for the current request."""
        with self._cond:
            return self._held
