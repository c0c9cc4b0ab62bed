"""Progress from inside an engine's long calls.

A service proves it is alive by its progress counter (``faults/health.py`` declares one hung when the counter stands
still for ``health.heartbeat_timeout_s``), and it counts one unit per loop step. At real sizes one step is one long
engine call (a rollout batch of hundreds of tokens over a 152k vocabulary, an update over tens of thousands of
tokens) that can outlast the timeout on a CPU while working as it should. So the service lends the engine its
counter for the call (:func:`reporting_progress`), and the engine calls :func:`tick` at each unit of real work: a
decode step, a micro-batch, an LM-head chunk, a poll of a Trainer group's ranks inside the group's own deadline. A
call that is stuck stops ticking and is still caught. Pure Python (no torch): the services import it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["reporting_progress", "tick"]

_local = threading.local()  # per thread: the colocated mode runs each service as a thread of one process


@contextmanager
def reporting_progress(on_tick: Callable[[], None]) -> Iterator[None]:
    """Within the block, :func:`tick` on this thread calls ``on_tick``."""
    previous = getattr(_local, "on_tick", None)
    _local.on_tick = on_tick
    try:
        yield
    finally:
        _local.on_tick = previous


def tick() -> None:
    """One unit of an engine call's work done (a no-op outside :func:`reporting_progress`)."""
    on_tick: Callable[[], None] | None = getattr(_local, "on_tick", None)
    if on_tick is not None:
        on_tick()
