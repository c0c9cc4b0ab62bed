"""``relax chaos``: a run with faults injected at seeded random times, ending with the fault table — faults
injected, detected, recovered, time to recover, and the prompts lost and duplicated (both must be 0).

Besides the services' faults, a plan can kill the run's other actors (queues, weight stores, health monitor), as
Ray's memory monitor does on a node short of memory: mid-run, and during the global restart that follows."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from relax_services.config import ACTOR_TARGETS, FaultSpec, RunConfig

__all__ = [
    "CHAOS_DEFAULTS",
    "actor_faults",
    "chaos_config",
    "chaos_targets",
    "fault_table",
    "global_restarts_needed",
    "random_faults",
    "run_chaos",
]

CHAOS_DEFAULTS = [
    "trainer.total_steps=40",
    "trainer.target_reward=null",
    "trainer.checkpoint_every=5",
    "trainer.groups_per_step=8",
    "trainer.micro_batch_groups=8",
    "data.tasks=[image, text]",
    "data.train_per_task=32",
    "data.eval_per_task=8",
    "algorithm.kl_coef=0.01",
    "health.heartbeat_timeout_s=6",
    "health.max_restarts=5",
    "queue.lease_timeout_s=6",
    "eval.every_steps=20",
]
"""A short run with every service (the KL term brings in the Reference) and quick fault detection."""

_KINDS = ("kill", "raise", "hang")


def chaos_targets(cfg: RunConfig, evaluator: bool = False) -> tuple[str, ...]:
    """The roles a run of ``cfg`` has that faults can hit: the Reference only with a KL term, the Critic only
    for PPO, the Evaluator (``eval``) only when ``evaluator`` (``relax chaos --eval-faults``): it makes no training
    data, so a plan that measures what faults cost training leaves it out unless asked."""
    roles = ["rollout", "reward"]
    if cfg.algorithm.uses_reference:
        roles.append("reference")
    if cfg.algorithm.uses_critic:
        roles.append("critic")
    if evaluator:
        roles.append("eval")
    return (*roles, "trainer")


def random_faults(
    n: int, seed: int, total_steps: int, services: tuple[str, ...] = ("rollout", "reward", "reference", "trainer")
) -> list[FaultSpec]:
    """``n`` faults at distinct random steps in the run's middle, covering every kind and every one of
    ``services`` as far as ``n`` allows: each is drawn from a shuffled round of the choices not used yet, so 3
    faults are one of each kind and 5 faults on the four default roles hit each role and each kind."""
    rng = random.Random(seed)
    lo, hi = 2, max(3, total_steps - 4)
    steps = sorted(rng.sample(range(lo, hi), min(n, hi - lo)))
    roles, kinds = _rounds(rng, services, len(steps)), _rounds(rng, _KINDS, len(steps))
    return [
        FaultSpec.model_validate({"service": role, "kind": kind, "at_step": s})
        for role, kind, s in zip(roles, kinds, steps, strict=True)
    ]


def _rounds(rng: random.Random, choices: tuple[str, ...], n: int) -> list[str]:
    """``n`` picks from ``choices``: whole shuffled rounds of them, then part of one more."""
    picks: list[str] = []
    while len(picks) < n:
        picks += rng.sample(choices, len(choices))
    return picks[:n]


def actor_faults(
    n: int, seed: int, total_steps: int, taken: set[int] | None = None, critic: bool = False
) -> list[FaultSpec]:
    """``n`` SIGKILLs of the pipeline's non-service actors, in pairs: a queue actor killed mid-run at a random step
    (not one of ``taken``, the steps of the services' faults, where there is one left), then another actor (a
    queue, a weight store — the critic's only with ``critic`` — or the health monitor) killed during the global
    restart that the first one causes."""
    rng = random.Random(f"actors-{seed}")
    lo, hi = 2, max(3, total_steps - 4)
    free = [s for s in range(lo, hi) if s not in (taken or set())] or list(range(lo, hi))
    targets = tuple(t for t in ACTOR_TARGETS if critic or t != "critic_weights")
    faults: list[FaultSpec] = []
    step = lo
    for i in range(n):
        if i % 2 == 0:
            step = rng.choice(free)
            target, during = rng.choice(("prompt_queue", "sample_queue")), False
        else:
            target, during = rng.choice(targets), True
        faults.append(
            FaultSpec.model_validate({"service": target, "kind": "kill", "at_step": step, "during_restart": during})
        )
    return faults


def global_restarts_needed(faults: list[FaultSpec], hosts: list[list[str]] | None = None) -> int:
    """Global restarts a fault plan causes by design: one per Trainer fault (other roles restart in place), one
    per kill, hang or break of a role sharing the Trainer's process (``hosts``: ``run.hosts``; its process is
    replaced, the Trainer with it), one per killed queue, store or monitor actor, and one per kill during a global
    restart (it interrupts that attempt)."""
    with_trainer = next((set(host) for host in hosts or [] if "trainer" in host), set())
    return sum(
        f.service == "trainer"
        or f.service in ACTOR_TARGETS
        or (f.service in with_trainer and f.kind in ("kill", "hang", "break"))
        for f in faults
    )


def fault_table(events: list[dict[str, Any]], ledger: dict[str, int]) -> str:
    """One line per injected fault: when it was detected and recovered, from the run's health events."""
    lines = [f"{'service':<14} {'kind':<6} {'step':>5} {'detected':>9} {'recovered':>10}  how"]
    recovered_all = True
    for i, event in enumerate(events):
        if event["event"] != "injected":
            continue
        later = events[i + 1 :]
        detected = next((e for e in later if e["event"] == "detected" and e["service"] == event["service"]), None)
        # A global restart replaces every service, the faulty one included: it recovers any fault it absorbs.
        restart = next((e for e in later if e["event"] == "recovered"), None)
        if event.get("during_restart"):
            done, how = restart, "killed during a global restart: restarted again from the last checkpoint"
        elif event["service"] == "trainer" or event["service"] in ACTOR_TARGETS:
            done, how = restart, "global restart from the last checkpoint"
        else:
            done = next((e for e in later if e["event"] == "restarted" and e["service"] == event["service"]), None)
            how = "restarted in place"
            if restart is not None and (done is None or restart["time"] < done["time"]):
                done, how = restart, "replaced by a global restart"
        recovered_all &= done is not None
        det = f"{detected['time'] - event['time']:.1f}s" if detected else "no"
        rec = f"{done['time'] - event['time']:.1f}s" if done else "no"
        lines.append(f"{event['service']:<14} {event['fault']:<6} {event['step']:>5} {det:>9} {rec:>10}  {how}")
    injected = sum(e["event"] == "injected" for e in events)
    lines.append(
        f"faults injected {injected}, all recovered: {'yes' if recovered_all else 'NO'}; "
        f"prompts lost {ledger.get('lost', 'n/a')}, duplicated {ledger.get('duplicated', 'n/a')}"
    )
    return "\n".join(lines)


def chaos_config(
    config: Path | None,
    overrides: list[str],
    n_faults: int,
    seed: int,
    n_actor_faults: int = 0,
    evaluator: bool = False,
) -> RunConfig:
    """The run config of ``relax chaos``: :data:`CHAOS_DEFAULTS` under ``overrides``, with ``n_faults`` seeded faults
    on the run's roles (the Evaluator among them with ``evaluator``) and ``n_actor_faults`` on its other actors
    (:func:`actor_faults`), and enough global restarts allowed for them.

    Raises:
        ConfigError: for a bad config or override.
    """
    from relax_services.config import load_run_config

    cfg = load_run_config(config, [*CHAOS_DEFAULTS, *overrides])
    faults = random_faults(n_faults, seed, cfg.trainer.total_steps, chaos_targets(cfg, evaluator))
    taken = {f.at_step for f in faults}
    faults += actor_faults(n_actor_faults, seed, cfg.trainer.total_steps, taken, critic=cfg.algorithm.uses_critic)
    # Each Trainer or actor fault is a global restart by design: the plan must not exhaust the run's allowance of
    # them (one more is left for a service that keeps failing).
    needed = global_restarts_needed(faults, cfg.run.hosts) + 1
    health = cfg.health.model_copy(update={"max_global_restarts": max(cfg.health.max_global_restarts, needed)})
    return cfg.model_copy(update={"faults": faults, "health": health})


def run_chaos(
    config: Path | None,
    overrides: list[str],
    n_faults: int,
    seed: int,
    n_actor_faults: int = 0,
    evaluator: bool = False,
) -> int:
    """Run with ``n_faults`` random faults on services (the Evaluator among them with ``evaluator``) and
    ``n_actor_faults`` on the other actors; print the fault table; exit status 1 if the run ended with an error, any
    fault was not recovered from, or a prompt was lost or duplicated."""
    import sys

    from relax_core import ConfigError
    from relax_services.control.preflight import check_run, make_run_dir

    try:
        cfg = chaos_config(config, overrides, n_faults, seed, n_actor_faults, evaluator)
        faults = cfg.faults
        run_dir = make_run_dir(cfg, check_run(cfg))
    except ConfigError as exc:
        print(f"relax chaos: {exc}", file=sys.stderr)
        return 2
    print(f"relax chaos: {len(faults)} faults → {run_dir}", flush=True)
    from relax_services.control.launch import LaunchError, launch
    from relax_services.reporting.summary import format_summary

    try:
        result = launch(cfg, run_dir)
    except LaunchError as exc:
        print(f"relax chaos: {exc}", file=sys.stderr)
        return 2
    table = fault_table(result.health_events, result.ledger)
    (run_dir / "faults.txt").write_text(table + "\n", encoding="utf-8")
    print(format_summary(result), flush=True)
    print(table, flush=True)
    if result.error:
        print(f"relax chaos: {result.error}", file=sys.stderr)
    ok = "NO" not in table.splitlines()[-1] and result.ledger.get("lost") == 0 and result.ledger["duplicated"] == 0
    return 0 if ok and not result.error else 1
