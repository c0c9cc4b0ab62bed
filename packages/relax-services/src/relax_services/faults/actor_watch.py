"""Watching a pipeline's actors that are not services: the prompt and sample queues, the weight stores and the
health monitor.

They have no work loop and send no heartbeat, so their death (Ray's memory monitor, a SIGKILL, a crash) shows only
as errors of calls to them, in whichever process makes the next call. The controller pings them instead: one ping
per actor in flight at a time, read without waiting on every tick of its loop (:meth:`ActorWatch.poll`), and a
waiting check (:meth:`ActorWatch.check`) before it restarts a service in place and at the end of a global restart.
A dead one raises :class:`ActorLost`, which the controller answers with a global restart from the last checkpoint
(the queues' contents are in its snapshots, so the ledger stays exact).

Several keys may name one process (the queues, the policy weight store and the health monitor share one, see
``_light_host``): it is pinged once, and its death is reported under the key a fault injection said it killed
(:meth:`ActorWatch.killed`), else under its first key, naming the others it took with it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from relax_services.faults.health import GlobalRestartNeeded, memory_kill

__all__ = ["ACTOR_TITLES", "ActorLost", "ActorWatch", "actor_lost", "creation_error", "why_dead"]

ACTOR_TITLES: dict[str, str] = {
    "prompt_queue": "the prompt queue",
    "sample_queue": "the sample queue",
    "weights": "the policy weight store",
    "critic_weights": "the critic weight store",
    "health_monitor": "the health monitor",
}
"""Actor key (as :meth:`relax_services.control.pipeline.Pipeline.actors` names them and faults target them) → what it
is."""

_EXIT_TYPE = re.compile(r"Worker exit type: (\w+)")
_CREATION = "error raised in its creation task"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RAISED = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning)\b.*")
_CAUSE_CHARS = 400


class ActorLost(GlobalRestartNeeded):
    """One of the pipeline's queue, weight-store or health-monitor actors died.

    Attributes:
        actor: its key in :data:`ACTOR_TITLES`.
        why: why, as far as Ray says (e.g. killed by its memory monitor), and the other actors its process held.
        shared: the keys of the other actors that died with it (they shared its process).
    """

    def __init__(self, actor: str, why: str, shared: Sequence[str] = ()) -> None:
        self.actor, self.shared = actor, tuple(shared)
        if self.shared:
            held = ", ".join(f"{ACTOR_TITLES.get(key, key)} ({key})" for key in self.shared)
            why = f"{why}; its process held {held} too"
        self.why = why
        super().__init__(f"{ACTOR_TITLES.get(actor, actor)} actor ({actor}) died: {why}")


def why_dead(exc: BaseException) -> str:
    """Why an actor died, from the error of a call to it (Ray's texts: its memory monitor, the worker's exit)."""
    if memory_kill(exc):
        return "killed by Ray's memory monitor (OutOfMemoryError: the node ran low on memory)"
    exit_type = _EXIT_TYPE.search(str(exc))
    if exit_type is not None and exit_type.group(1) == "SYSTEM_ERROR":
        return "its process ended unexpectedly (Ray: SYSTEM_ERROR; a SIGKILL, the kernel's OOM killer or a crash)"
    if exit_type is not None:
        return f"its process ended (Ray: worker exit type {exit_type.group(1)})"
    first = str(exc).strip().splitlines()
    if _CREATION in str(exc):
        raised = creation_error(str(exc))
        if raised:
            return f"{type(exc).__name__}: its constructor raised {raised}"
    return f"{type(exc).__name__}: {first[0] if first else 'no detail'}"


def creation_error(text: str) -> str | None:
    """The exception an actor's ``__init__`` raised, from Ray's text of the death it caused (its traceback ends in
    ``Type: message``; the message's lines joined, at most 400 characters): Ray's first line only names the
    actor. None when the text has no such line."""
    lines = [_ANSI.sub("", line).rstrip() for line in text.splitlines()]
    frames = [i for i, line in enumerate(lines) if line.lstrip().startswith('File "')]
    for i in range(frames[-1] + 1 if frames else 1, len(lines)):
        if _RAISED.match(lines[i]):
            message = " ".join(line.strip() for line in lines[i:] if line.strip())
            return message if len(message) <= _CAUSE_CHARS else message[: _CAUSE_CHARS - 1] + "…"
    return None


def actor_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is Ray reporting an actor gone (its process died, or it was killed)."""
    import sys

    ray = sys.modules.get("ray")  # no Ray imported (the colocated mode): no actor to lose
    return ray is not None and isinstance(exc, ray.exceptions.RayActorError)


class ActorWatch:
    """Pings a pipeline's non-service actors (``key → handle``) to notice any of them die.

    A ping is Ray's built-in ``__ray_ready__`` call: a dead actor's fails at once, a live one answers as soon as its
    event loop is free. An actor busy past a check's timeout counts as alive (a hang is not a death). Keys with equal
    handles are one process, pinged once under the first of them.
    """

    def __init__(self, actors: Mapping[str, Any]) -> None:
        self.actors = dict(actors)
        self._probes: dict[str, Any] = {}  # key -> handle, one key per process
        for key, actor in self.actors.items():
            if not any(actor == seen for seen in self._probes.values()):
                self._probes[key] = actor
        self._pending: dict[str, Any] = {}  # probe key -> the ping in flight
        self._killed: set[str] = set()

    def killed(self, key: str) -> None:
        """Fault injection is killing actor ``key``'s process: its death is reported under ``key`` (once)."""
        self._killed.add(key)

    def poll(self) -> None:
        """Read the pings that were answered (without waiting) and send new ones where none is in flight.

        Raises:
            ActorLost: an actor's ping failed.
        """
        if not self._probes:
            return
        import ray

        if self._pending:
            refs = list(self._pending.values())
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            answered = set(done)
            for key, ref in list(self._pending.items()):
                if ref in answered:
                    del self._pending[key]
                    self._read(key, ref)
        for key, actor in self._probes.items():
            if key not in self._pending:
                self._pending[key] = actor.__ray_ready__.remote()

    def check(self, timeout_s: float = 30.0) -> None:
        """Ping every actor and wait up to ``timeout_s`` for all answers.

        Raises:
            ActorLost: an actor's ping failed.
        """
        if not self._probes:
            return
        import ray

        pings = {key: actor.__ray_ready__.remote() for key, actor in self._probes.items()}
        done, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=timeout_s)
        answered = set(done)
        for key, ref in pings.items():
            if ref in answered:
                self._read(key, ref)

    def find(self, exc: BaseException, timeout_s: float = 30.0) -> ActorLost | None:
        """The actor whose death ``exc`` (an error of some call) reports, found by a waiting :meth:`check`."""
        try:
            self.check(timeout_s)
        except ActorLost as lost:
            return lost
        return None

    def pid(self, key: str, timeout_s: float = 60.0) -> int:
        """The process id of actor ``key`` (for fault injection)."""
        import ray

        # An inline function travels by value: the actor's process need not import this module (and through it
        # the config and the model stack).
        return int(ray.get(self.actors[key].__ray_call__.remote(lambda _actor: os.getpid()), timeout=timeout_s))

    def _read(self, key: str, ref: Any) -> None:
        import ray

        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayActorError as exc:
            raise self._lost(key, why_dead(exc)) from exc
        except ray.exceptions.GetTimeoutError:  # answered per ray.wait: not expected, and not a death
            pass

    def _lost(self, key: str, why: str) -> ActorLost:
        """The report of the death of probe ``key``'s process: under the key fault injection killed, if it named one
        of the process's keys, else under ``key``; the process's other keys as ``shared``."""
        sharing = [other for other, actor in self.actors.items() if actor == self.actors[key]]
        named = next((other for other in sharing if other in self._killed), key)
        self._killed.discard(named)
        return ActorLost(named, why, shared=[other for other in sharing if other != named])
