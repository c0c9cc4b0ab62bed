"""When to add or remove a Rollout replica, decided from waits alone (``rollout.autoscale``).

The decision is a pure function of what the run reports, so it is tested on synthetic series: one
:class:`UpdateWaits` per update (the Trainer's seconds waiting for a batch and training on it, from its ``train``
record; the replicas' seconds working and blocked since the previous update, from their ``rollout`` records) and the
run's clock. :class:`Autoscaler` keeps the last ``window`` of them and answers with the replica count to move to, or
None. The controller applies the answer through the path ``relax scale`` takes (:mod:`relax_services.control.scaling`).

Over a full window:

- the Trainer's wait share ``Σ wait_s / Σ (wait_s + train_s)`` above ``up_wait_frac``: one replica more (up to
  ``max``), rollout is the bottleneck;
- else the replicas' blocked share ``Σ blocked_s / Σ (blocked_s + busy_s)`` above ``down_block_frac``: one replica
  less (down to ``min``), rollout is ahead of what τ and the queue let it hand over;
- nothing within ``cooldown_s`` of the last change (or of the start), and after a change the window starts empty:
  the next decision reads only updates made with the new count.

Light: the standard library only.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from relax_services.config.services import AutoscaleConfig

__all__ = ["Autoscaler", "UpdateWaits"]


@dataclass(frozen=True)
class UpdateWaits:
    """What one update tells the autoscaler.

    Attributes:
        wait_s: Seconds the Trainer waited for this update's batch.
        train_s: Seconds the Trainer spent on the update itself.
        busy_s: Seconds the replicas generated since the previous update (summed over replicas).
        blocked_s: Seconds the replicas could not work since the previous update (summed over replicas): a put
            blocked on the full sample queue, or no admitted prompt to take.
    """

    wait_s: float
    train_s: float
    busy_s: float = 0.0
    blocked_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("wait_s", "train_s", "busy_s", "blocked_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"UpdateWaits.{name} must be >= 0, got {getattr(self, name)}")


def _share(part: float, rest: float) -> float:
    total = part + rest
    return part / total if total > 0 else 0.0


class Autoscaler:
    """The replica count to move to, from the last ``cfg.window`` updates (see the module's rules).

    Args:
        cfg: The bounds, window, thresholds and cool-down.
        start_s: The run's clock when scaling may start counting its cool-down (the run's start).
    """

    def __init__(self, cfg: AutoscaleConfig, start_s: float = 0.0) -> None:
        self.cfg = cfg
        self._window: deque[UpdateWaits] = deque(maxlen=cfg.window)
        self._last_change_s = start_s

    def observe(self, waits: UpdateWaits) -> None:
        """Add one update's waits (the oldest leaves a full window)."""
        self._window.append(waits)

    def shares(self) -> tuple[float, float]:
        """The window's Trainer wait share and replica blocked share (0 for an empty window)."""
        wait = sum(w.wait_s for w in self._window)
        train = sum(w.train_s for w in self._window)
        blocked = sum(w.blocked_s for w in self._window)
        busy = sum(w.busy_s for w in self._window)
        return _share(wait, train), _share(blocked, busy)

    def decide(self, now_s: float, replicas: int) -> int | None:
        """The count to move to from ``replicas`` at ``now_s`` on the run's clock, or None (keep it).

        A count outside ``[min, max]`` (set by hand) is brought back in bounds one replica at a time, cool-down
        permitting, whatever the waits say.
        """
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        if now_s - self._last_change_s < self.cfg.cooldown_s:
            return None
        if replicas < self.cfg.min:
            return replicas + 1
        if replicas > self.cfg.max:
            return replicas - 1
        if len(self._window) < self.cfg.window:
            return None
        wait_share, blocked_share = self.shares()
        if wait_share > self.cfg.up_wait_frac and replicas < self.cfg.max:
            return replicas + 1
        if blocked_share > self.cfg.down_block_frac and replicas > self.cfg.min:
            return replicas - 1
        return None

    def changed(self, now_s: float) -> None:
        """A change of the count took effect at ``now_s`` (whoever made it): the cool-down starts and the window
        empties."""
        self._last_change_s = now_s
        self._window.clear()
