"""``relax bench replicas``: the same run with 1, 2, 3 ... Rollout replicas, side by side on one machine.

For each count it reports the steady-state samples/s (between the first and the last update), the speedup over the
first count, the Trainer's idle share (waiting for samples), the replicas' blocked share (no admitted prompt, or a
full queue) and how the consumed samples split between replicas. The defaults make rollout the slower side (longer
responses, one group per generate call, τ = 4), where replicas can help; on a machine with fewer cores than processes
they share the cores, which the idle and blocked shares show.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from relax_services.bench.pipeline import steady_state
from relax_services.reporting.metrics import read_metrics

if TYPE_CHECKING:
    from relax_services.control.controller import RunResult

__all__ = [
    "REPLICA_BENCH_DEFAULTS",
    "ReplicaRow",
    "format_replica_table",
    "live_scaling_figures",
    "replica_row",
    "run_replica_bench",
]

REPLICA_BENCH_DEFAULTS = [
    "trainer.total_steps=40",
    "trainer.max_minutes=4",
    "trainer.target_reward=null",
    "trainer.warmup_format_steps=0",
    "eval.every_steps=1000",
    "run.progress=none",
    "data.tasks=[text]",
    "staleness.tau=4",
    "rollout.groups_per_call=1",
    "rollout.max_new_tokens=16",
]
"""Overrides applied before the user's: a fixed number of updates of a rollout-bound text run, quiet progress."""


class ReplicaRow(TypedDict):
    """One count's figures."""

    replicas: int
    steps: int
    samples_per_s: float
    idle: float  # the Trainer's share of time waiting for samples, after its first update
    blocked: float  # the replicas' share of time blocked (no admitted prompt, or a full queue)
    split: dict[str, int]  # consumed samples by the replica that generated them


def replica_row(count: int, result: RunResult) -> ReplicaRow:
    """One count's figures from its run folder."""
    measured = steady_state(result.run_dir)
    rollout = list(read_metrics(result.run_dir / "metrics.jsonl", "rollout"))
    busy = sum(r["seconds"] for r in rollout)
    blocked = sum(r.get("blocked_s", 0.0) for r in rollout)
    split: Counter[str] = Counter()
    for record in read_metrics(result.run_dir / "metrics.jsonl", "train"):
        split.update(record["samples_by_replica"])
    return {
        "replicas": count,
        "steps": result.steps,
        "samples_per_s": measured["samples_per_s"],
        "idle": measured["idle"],
        "blocked": blocked / max(blocked + busy, 1e-9),
        "split": dict(sorted(split.items())),
    }


def format_replica_table(rows: list[ReplicaRow]) -> str:
    """The side-by-side table; the speedup is relative to the first row."""
    base = rows[0]["samples_per_s"]
    header = f"{'replicas':>8} {'steps':>5} {'samples/s':>10} {'speedup':>8} {'trainer idle':>12} {'blocked':>8}"
    lines = [f"{header}  split"]
    for row in rows:
        rate = row["samples_per_s"]
        shown = " ".join(f"{k}:{v}" for k, v in row["split"].items())
        lines.append(
            f"{row['replicas']:>8} {row['steps']:>5} {rate:>10.1f} {rate / max(base, 1e-9):>7.2f}× "
            f"{row['idle']:>12.2f} {row['blocked']:>8.2f}  {shown}"
        )
    return "\n".join(lines)


def _phase(train: list[dict[str, float]], start: float, end: float) -> tuple[float, float]:
    """Samples/s and the Trainer's idle share of the updates recorded in ``[start, end)`` on the run's clock."""
    rows = [r for r in train if start <= r["wall"] < end]
    if len(rows) < 2:
        return float("nan"), float("nan")
    rate = sum(r["samples"] for r in rows[1:]) / max(rows[-1]["wall"] - rows[0]["wall"], 1e-9)
    return rate, sum(r["wait_s"] for r in rows) / max(sum(r["wait_s"] + r["train_s"] for r in rows), 1e-9)


def live_scaling_figures(run_dir: Path) -> dict[str, float]:
    """From a run scaled out to ``rollout-1`` and back: seconds from the request to the replica's admission and to
    its first consumed sample, samples/s and Trainer idle share before the scale-out, while it joined, after it and
    after the scale-in, and the drain's seconds (NaN where the run has no such phase)."""
    path = run_dir / "metrics.jsonl"
    scale = list(read_metrics(path, "scale"))
    train = list(read_metrics(path, "train"))
    nan = float("nan")

    def wall(event: str, nth: int = 0) -> float:
        found = [r["wall"] for r in scale if r["event"] == event]
        return float(found[nth]) if len(found) > nth else nan

    asked, joined, asked_in = wall("requested"), wall("joined"), wall("requested", 1)
    first = next((r["wall"] for r in train if r["samples_by_replica"].get("rollout-1")), nan)
    removed = next((r for r in scale if r["event"] == "removed"), None)
    end = float("inf") if math.isnan(asked_in) else asked_in
    phases = {
        "before": _phase(train, 0.0, asked),
        "joining": _phase(train, asked, joined),
        "after": _phase(train, joined, end),
        "after_in": (nan, nan) if math.isnan(asked_in) else _phase(train, asked_in, float("inf")),
    }
    figures = {"join_s": joined - asked, "first_sample_s": first - asked}
    figures["drain_s"] = float(removed["seconds"]) if removed is not None else nan
    for name, (rate, idle) in phases.items():
        figures[f"{name}_samples_per_s"], figures[f"{name}_idle"] = rate, idle
    return figures


def _drive_live_scaling(run_dir: Path, out_at: int, in_at: int, answers: dict[str, object]) -> None:
    """Scale ``run_dir``'s run to 2 replicas once it reached update ``out_at`` and back to 1 at ``in_at``."""
    import time

    from relax_services.control.endpoint import CONTROL_FILE, send_request

    def reached(step: int) -> bool:
        path = run_dir / "metrics.jsonl"
        return (run_dir / CONTROL_FILE).exists() and any(r["step"] >= step for r in read_metrics(path, "train"))

    try:
        for step, count in ((out_at, 2), (in_at, 1)):
            while not reached(step):
                time.sleep(0.25)
            answers[str(count)] = send_request(run_dir, {"op": "scale", "role": "rollout", "count": count})
    except Exception as exc:  # the run ended first: the figures say which phases it had
        answers["error"] = f"{type(exc).__name__}: {exc}"


def run_replica_bench(counts: str, overrides: list[str], config: Path | None, live: bool = False) -> int:
    """Run the same config once per replica count (one Ray instance for all) and print the table after each; with
    ``live``, then one run from 1 replica scaled to 2 at a quarter of its updates and back to 1 at three quarters,
    with :func:`live_scaling_figures`."""
    import ray

    from relax_services.config import load_run_config
    from relax_services.control.launch import launch
    from relax_services.control.preflight import make_run_dir
    from relax_services.hosting.ray_init import init_ray

    values = [int(c) for c in counts.split(",")]
    if not values or min(values) < 1:
        raise ValueError(f"--counts {counts!r}: replica counts are whole numbers >= 1")
    rows: list[ReplicaRow] = []
    started = init_ray(None)
    try:
        for count in values:
            cfg = load_run_config(config, [*REPLICA_BENCH_DEFAULTS, *overrides, f"rollout.replicas={count}"])
            cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": None})})
            run_dir = make_run_dir(cfg)
            run_dir = run_dir.rename(run_dir.with_name(f"{run_dir.name}-bench-replicas{count}"))
            print(f"relax bench replicas: {count} → {run_dir}", flush=True)
            rows.append(replica_row(count, launch(cfg, run_dir)))
            print(format_replica_table(rows), flush=True)
        if live:
            import threading

            cfg = load_run_config(config, [*REPLICA_BENCH_DEFAULTS, *overrides, "rollout.replicas=1"])
            cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": None})})
            run_dir = make_run_dir(cfg)
            run_dir = run_dir.rename(run_dir.with_name(f"{run_dir.name}-bench-live"))
            total = cfg.trainer.total_steps
            answers: dict[str, object] = {}
            driver = threading.Thread(
                target=_drive_live_scaling, args=(run_dir, total // 4, 3 * total // 4, answers), daemon=True
            )
            print(f"relax bench replicas: live 1 → 2 → 1 → {run_dir}", flush=True)
            driver.start()
            launch(cfg, run_dir)
            driver.join(timeout=60)
            figures = live_scaling_figures(run_dir)
            print(f"live scaling: {answers}", flush=True)
            print("  ".join(f"{k}={v:.3g}" for k, v in figures.items()), flush=True)
    finally:
        if started:
            ray.shutdown()
    return 0
