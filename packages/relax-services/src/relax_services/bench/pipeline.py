"""``relax bench pipeline``: the same task and seeds at τ = 0 and τ > 0, side by side in one run.

For each τ it reports samples/s, time to a held-out reward threshold, the trainer's idle fraction, the
staleness histogram and the final reward; from the τ = 0 run's measured rollout time R and train time T per
step it computes the overlap bound (R + T) / max(R, T) and the fraction of it each async run achieves.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax_services.reporting.metrics import read_metrics

if TYPE_CHECKING:
    from relax_services.control.controller import RunResult

__all__ = ["BENCH_DEFAULTS", "format_bench_table", "run_pipeline_bench"]

BENCH_DEFAULTS = [
    "trainer.total_steps=40",
    "trainer.max_minutes=4",
    "trainer.target_reward=null",
    "eval.every_steps=10",
    "run.progress=none",
]
"""Overrides applied before the user's: a fixed number of updates, no early stop, quiet progress."""


def steady_state(run_dir: Path) -> dict[str, float]:
    """Throughput and phase times once training runs (start-up, data writing and warm-up excluded): samples/s
    between the first and the last update, trainer idle fraction after the first update, and rollout time R and
    train time T per update."""
    train = list(read_metrics(run_dir / "metrics.jsonl", "train"))
    rollout = list(read_metrics(run_dir / "metrics.jsonl", "rollout"))
    later = train[1:]
    span = train[-1]["wall"] - train[0]["wall"] if len(train) > 1 else float("nan")
    wait = sum(r["wait_s"] for r in later)
    busy = sum(r["train_s"] for r in later)
    samples_per_step = train[0]["samples"] if train else 0
    generated = sum(r["samples"] for r in rollout)
    return {
        "samples_per_s": sum(r["samples"] for r in later) / span if span > 0 else float("nan"),
        "idle": wait / max(wait + busy, 1e-9),
        "R": sum(r["seconds"] for r in rollout) / max(generated / max(samples_per_step, 1), 1e-9),
        "T": sum(r["train_s"] for r in train) / max(len(train), 1),
    }


def _row(tau: int | None, result: RunResult) -> dict[str, object]:
    measured = steady_state(result.run_dir)
    return {
        "tau": "inf" if tau is None else str(tau),
        **measured,
        "final": sum(result.final_eval.values()) / max(len(result.final_eval), 1),
        "to_threshold": min(result.first_step_reaching.values(), default=None)
        if len(result.first_step_reaching) == len(result.chance)
        else None,
        "to_threshold_all": max(result.first_step_reaching.values())
        if len(result.first_step_reaching) == len(result.chance)
        else None,
        "staleness": result.staleness_hist,
        "steps": result.steps,
        "wall": result.wall_s,
    }


def format_bench_table(rows: list[dict[str, Any]]) -> str:
    """The side-by-side table; speedups are relative to the τ = 0 row (the synchronous trainer)."""
    base = next((r for r in rows if r["tau"] == "0"), rows[0])
    r_t, t_t = base["R"], base["T"]
    bound = (r_t + t_t) / max(r_t, t_t, 1e-9)
    header = (
        f"{'tau':>4} {'steps':>5} {'samples/s':>10} {'speedup':>8} {'of bound':>9} {'idle':>6} "
        f"{'t→0.8 all':>10} {'final':>6}  staleness (V−v_min:count)"
    )
    lines = [
        f"overlap bound from τ=0: R={r_t:.3f}s T={t_t:.3f}s per step → (R+T)/max(R,T) = {bound:.2f}×",
        header,
    ]
    for r in rows:
        speedup = r["samples_per_s"] / max(base["samples_per_s"], 1e-9)
        of_bound = speedup / bound
        thr = f"{r['to_threshold_all']:.0f}s" if r["to_threshold_all"] is not None else "-"
        hist = " ".join(f"{k}:{v}" for k, v in r["staleness"].items())
        lines.append(
            f"{r['tau']:>4} {r['steps']:>5} {r['samples_per_s']:>10.1f} {speedup:>7.2f}× {of_bound:>8.2f} "
            f"{r['idle']:>6.2f} {thr:>10} {r['final']:>6.3f}  {hist}"
        )
    return "\n".join(lines)


def run_pipeline_bench(taus: str, overrides: list[str], config: Path | None) -> int:
    """Run the pipeline once per τ (same config and seeds) and print the table."""
    import ray

    from relax_services.config import load_run_config
    from relax_services.control.launch import launch
    from relax_services.control.preflight import make_run_dir
    from relax_services.hosting.ray_init import init_ray

    values: list[int | None] = [None if t.strip() in ("inf", "null") else int(t) for t in taus.split(",")]
    rows = []
    started = init_ray(None)  # one Ray instance for every τ: each launch finds it started
    try:
        for tau in values:
            tau_text = "null" if tau is None else str(tau)
            cfg = load_run_config(config, [*BENCH_DEFAULTS, *overrides, f"staleness.tau={tau_text}"])
            cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": None})})
            run_dir = make_run_dir(cfg)
            run_dir = run_dir.rename(run_dir.with_name(f"{run_dir.name}-bench-tau{tau_text}"))
            print(f"relax bench: τ={tau_text} → {run_dir}", flush=True)
            result = launch(cfg, run_dir)
            rows.append(_row(tau, result))
            print(format_bench_table(rows), flush=True)
    finally:
        if started:
            ray.shutdown()
    return 0
