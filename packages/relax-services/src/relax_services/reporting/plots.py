"""PNG plots written into a run folder: reward per modality against wall-clock time, the staleness
histogram of consumed samples, and queue depth over time."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from types import ModuleType

from relax_services.reporting.metrics import read_metrics


def _pyplot() -> ModuleType:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(run_dir: Path) -> list[Path]:
    """Draw every plot for the run in ``run_dir`` (which holds ``metrics.jsonl``); return the files written."""
    metrics = run_dir / "metrics.jsonl"
    written = [
        _plot_reward(metrics, run_dir / "reward.png"),
        _plot_staleness(metrics, run_dir / "staleness.png"),
        _plot_queue(metrics, run_dir / "queue_depth.png"),
    ]
    return [p for p in written if p is not None]


def _plot_reward(metrics: Path, out: Path) -> Path | None:
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    chance: dict[str, float] = {}
    for row in read_metrics(metrics, "eval"):
        for task, value in row["reward"].items():
            series[task].append((row["wall"], value))
        chance.update(row.get("chance", {}))
    if not series:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for task, points in sorted(series.items()):
        xs, ys = zip(*points, strict=True)
        (line,) = ax.plot(xs, ys, marker="o", markersize=3, label=task)
        if task in chance:
            ax.axhline(chance[task], color=line.get_color(), linestyle=":", linewidth=1)
    ax.set_xlabel("wall-clock time (s)")
    ax.set_ylabel("held-out reward (dotted: chance)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("Held-out reward per modality")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _plot_staleness(metrics: Path, out: Path) -> Path | None:
    counts: dict[int, int] = defaultdict(int)
    for row in read_metrics(metrics, "train"):
        for staleness, n in row.get("staleness_hist", {}).items():
            counts[int(staleness)] += int(n)
    if not counts:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    keys = sorted(counts)
    ax.bar([str(k) for k in keys], [counts[k] for k in keys], color="tab:blue")
    ax.set_xlabel("staleness V − v_min of consumed samples")
    ax.set_ylabel("samples")
    ax.set_title("Staleness of consumed samples")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _plot_queue(metrics: Path, out: Path) -> Path | None:
    points = [(row["wall"], row["depth_rows"]) for row in read_metrics(metrics, "queue")]
    if not points:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs, ys = zip(*points, strict=True)
    ax.step(xs, ys, where="post")
    ax.set_xlabel("wall-clock time (s)")
    ax.set_ylabel("rows in queue")
    ax.set_title("Queue depth")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
