"""The end-of-run summary: reward reached per task against its chance level, the ledger, faults."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from relax_services.reporting._units import format_duration, format_rate

if TYPE_CHECKING:
    from relax_services.control.run_result import RunResult

__all__ = ["format_summary", "headline", "learned_line"]


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


def headline(result: RunResult) -> list[str]:
    """The summary's first lines: why and when the run stopped, its rate, and what the final weights' evaluation
    says against ``trainer.target_reward`` (the reward table below scores the same weights; an earlier evaluation
    that stopped the run is named, never given a number of its own)."""
    rate = format_rate(result.samples / max(result.wall_s, 1e-9))
    lines = [
        f"relax train finished: {result.stop_reason} after {result.steps} updates in "
        f"{format_duration(result.wall_s)} ({result.samples} samples, {rate} samples/s)"
    ]
    weights = (
        "the last evaluation" if result.final_version is None else f"final weights (version {result.final_version})"
    )
    target = result.target_reward
    if target is not None and result.final_eval:
        below = {t: v for t, v in sorted(result.final_eval.items()) if not v >= target}
        if not below:
            lines.append(f"{weights}: held-out reward >= {target} on every task")
        else:
            tasks = ", ".join(f"{t} {v:.3f}" for t, v in below.items())
            lines.append(f"{weights}: held-out reward below the target {target} on {tasks}")
        if result.target_version is not None and below:
            lines.append(f"(the run stopped when the evaluation of version {result.target_version} met the target)")
    return lines


def learned_line(result: RunResult) -> str:
    """What the run shows about learning from reward alone (no supervised warm-up).

    The rule: the run learned from reward alone when, on every task, the final weights' held-out reward is above
    the run's first evaluation (of an earlier version) and above the task's chance level (where it is known). Said
    only then; otherwise the line names each task that did not rise, with its first and final reward.
    """
    if result.warmup_steps:
        return (
            f"opened with {result.warmup_steps} supervised format warm-up steps (a random valid option, then "
            "end-of-answer; never the correct answer), so rewards start near chance"
        )
    first, final = result.first_eval, result.final_eval
    if result.first_eval_version is None or result.first_eval_version == result.final_version or not first:
        return "no supervised warm-up; no evaluation before the final one to compare it with"
    flat = []
    for task, value in sorted(final.items()):
        chance = result.chance.get(task, math.nan)
        if task not in first or not (value > first[task] and (math.isnan(chance) or value > chance)):
            start = f"{first[task]:.3f}" if task in first else "-"
            flat.append(f"{task} {start} -> {value:.3f}")
    since = f"the first evaluation (version {result.first_eval_version})"
    if not flat:
        return f"no supervised warm-up: held-out reward rose above {since} and above chance on every task"
    return f"no supervised warm-up; held-out reward did not rise above both {since} and chance on: " + ", ".join(flat)


def format_summary(result: RunResult) -> str:
    """The end-of-run text: held-out reward per task against chance, staleness, idle fraction, ledger, faults."""
    lines = [
        *headline(result),
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
        learned_line(result),
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
