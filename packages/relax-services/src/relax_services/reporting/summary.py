"""The end-of-run summary: reward reached per task against its chance level, the ledger, faults."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from relax_services.control.run_result import RunResult

__all__ = ["format_summary"]


def _data_lines(data: dict[str, Any]) -> list[str]:
    """The dataset files' lines: which files, held-out coverage, bad rows with the last few named."""
    lines = ["", "trained on: " + ", ".join(data["train_files"])]
    if not data["eval_files"]:
        lines.append("no held-out evaluation: data.eval_files not given")
    else:
        held = ", ".join(f"{s or '(no data_source)'}: {n}" for s, n in sorted(data["heldout_by_source"].items()))
        lines.append(f"held-out: {', '.join(data['eval_files'])} ({held or 'no readable row'})")
    for source, why in sorted(data.get("chance_unknown", {}).items()):
        lines.append(f"chance of {source} unknown ('-'): {why}")
    lines.append(f"bad rows skipped: {data['bad_rows']}")
    lines += [f"  {source} row {row}: {reason}" for source, row, reason in data["recent_bad_rows"][-5:]]
    return lines


def format_summary(result: RunResult) -> str:
    """The end-of-run text: held-out reward per task against chance, staleness, idle fraction, ledger, faults."""
    lines = [
        f"relax train finished: {result.stop_reason} after {result.steps} updates in {result.wall_s:.0f}s "
        f"({result.samples} samples, {result.samples / max(result.wall_s, 1e-9):.0f} samples/s)",
        "",
        f"{'task':<12} {'held-out reward':>16} {'chance':>8} {'reached 0.8 at':>15}"
        + ("" if result.final_version is None else f"   (reward: final weights, version {result.final_version})"),
    ]
    for task in sorted(result.chance):
        value = result.final_eval.get(task, float("nan"))
        reached = result.first_step_reaching.get(task)
        reached_text = f"{reached:.0f}s" if reached is not None else "-"
        chance = result.chance[task]
        chance_text = "-" if math.isnan(chance) else f"{chance:.3f}"  # unknown: the data lines say why
        lines.append(f"{task:<12} {value:>16.3f} {chance_text:>8} {reached_text:>15}")
    if result.data is not None:
        lines += _data_lines(result.data)
    hist = " ".join(f"{k}:{v}" for k, v in result.staleness_hist.items()) or "-"
    lines += [
        "",
        f"staleness of consumed samples (V − v_min: count): {hist}",
        f"trainer idle fraction: {result.trainer_wait_s / max(result.trainer_wait_s + result.train_s, 1e-9):.2f}",
        "prompt ledger: " + ", ".join(f"{k} {v}" for k, v in result.ledger.items()),
        "unreadable media skipped: "
        + (
            ", ".join(f"{split} {reason}: {n}" for split, r in result.skipped_media.items() for reason, n in r.items())
            or "none"
        ),
        (
            f"opened with {result.warmup_steps} supervised format warm-up steps (a random valid option, then "
            "end-of-answer; never the correct answer), so rewards start near chance"
            if result.warmup_steps
            else "no supervised warm-up: the policy learned the answer format from reward alone"
        ),
    ]
    resumed_from = result.resumed_from_s
    if resumed_from:
        lines.append(f"resumed after {resumed_from:.0f}s of earlier run time (included above)")
    for key, (old, new) in result.resume_changes.items():
        lines.append(f"changed on resume: {key} = {new!r} (the saved run had {old!r})")
    startup = result.startup
    if startup:
        lines.append("start-up (seconds from the command): " + ", ".join(f"{k} {v:.1f}" for k, v in startup.items()))
    if result.error:
        lines.append(f"ended early: {result.error}")
    restarts = [e for e in result.health_events if e["event"] == "restarted"]
    if result.health_events:
        lines.append(f"health events: {len(result.health_events)} ({len(restarts)} restarts)")
    lines.append(f"run folder: {result.run_dir}")
    return "\n".join(lines)
