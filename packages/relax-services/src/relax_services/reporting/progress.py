"""Live progress of a run: a redrawn table on a terminal, one line per report otherwise."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TypedDict

from relax_services.reporting._units import format_eta, format_rate

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["Progress", "ProgressState"]


class ProgressState(TypedDict):
    """One progress report (the controller builds it after every update)."""

    wall: float  # seconds since the run started
    step: int
    total_steps: int
    reward: float  # mean train reward of the last update
    eval: dict[str, float]  # newest held-out reward per task
    chance: dict[str, float]  # chance level per task
    max_staleness: int  # of the last update's samples
    depth_rows: int  # sample queue depth
    samples_per_s: float
    eta_s: float | None  # None before the first update (no update's duration known) or without a bound
    restarts: int  # service restarts so far


class Progress:
    """Shows step, reward per task, staleness, queue depth, samples/s and ETA.

    Args:
        mode: ``live`` (rich table, redrawn), ``lines`` (plain lines), ``none``, or ``auto`` (live on a TTY).
    """

    def __init__(self, mode: str = "auto") -> None:
        if mode == "auto":
            mode = "live" if sys.stdout.isatty() else "lines"
        self.mode = mode
        self._live: Any = None

    def __enter__(self) -> Progress:
        if self.mode == "live":
            from rich.live import Live

            self._live = Live(refresh_per_second=2, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self._live = None

    def update(self, state: ProgressState) -> None:
        """Show ``state`` (redraw the table, or print one line)."""
        if self.mode == "none":
            return
        if self.mode == "lines":
            print(self._line(state), flush=True)
            return
        self._live.update(self._table(state))

    @staticmethod
    def _line(s: ProgressState) -> str:
        evals = " ".join(f"{t}={v:.2f}" for t, v in sorted(s["eval"].items()))
        return (
            f"[{s['wall']:6.0f}s] step {s['step']}/{s['total_steps']}  train reward {s['reward']:.3f}  "
            f"held-out {evals or '-'}  staleness max {s['max_staleness']}  queue {s['depth_rows']} rows  "
            f"{format_rate(s['samples_per_s'])} samples/s  ETA {format_eta(s['step'], s['eta_s'])}"
        )

    @staticmethod
    def _table(s: ProgressState) -> Table:
        from rich.table import Table

        table = Table(title=f"relax train — step {s['step']}/{s['total_steps']}  ({s['wall']:.0f}s)")
        table.add_column("metric")
        table.add_column("value", justify="right")
        table.add_row("train reward (last step)", f"{s['reward']:.3f}")
        for task, value in sorted(s["eval"].items()):
            chance = s["chance"].get(task)
            suffix = f" (chance {chance:.2f})" if chance is not None else ""
            table.add_row(f"held-out reward: {task}", f"{value:.3f}{suffix}")
        table.add_row("max staleness (last step)", str(s["max_staleness"]))
        table.add_row("queue depth (rows)", str(s["depth_rows"]))
        table.add_row("samples/s", format_rate(s["samples_per_s"]))
        table.add_row("service restarts", str(s["restarts"]))
        table.add_row("ETA", format_eta(s["step"], s["eta_s"]))
        return table
