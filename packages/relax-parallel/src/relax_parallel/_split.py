"""Service split: how many GPUs go to rollout, training, reference and critic."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from relax_parallel._memory import BF16
from relax_parallel._plan import ParallelPlan
from relax_parallel._rollout import plan_rollout
from relax_parallel._search import InfeasiblePlanError, plan_training
from relax_parallel._specs import ClusterSpec, ModelSpec, WorkloadSpec

ALGORITHMS: dict[str, tuple[str, ...]] = {
    "grpo": ("rollout", "trainer", "reference"),
    "ppo": ("rollout", "trainer", "reference", "critic"),
}


@dataclass(frozen=True)
class Throughputs:
    """Measured samples per second per GPU of each service (each running on its own GPUs).

    Attributes:
        rollout: Generated samples/s/GPU.
        trainer: Trained samples/s/GPU.
        reference: Scored samples/s/GPU.
        critic: Critic-trained samples/s/GPU (PPO only).
        rollout_sync: Rollout samples/s/GPU in lock-step, where each batch waits for its slowest sample;
            defaults to ``rollout``.
    """

    rollout: float
    trainer: float
    reference: float = 0.0
    critic: float = 0.0
    rollout_sync: float = 0.0


@dataclass(frozen=True)
class ServiceSplit:
    """A recommended GPU split and its predicted speed.

    Attributes:
        tau: Staleness bound the split was planned for.
        gpus: GPUs per service.
        stage_seconds: Predicted seconds per step of each service on its GPUs.
        sync_step_s: Step time of the colocated synchronous baseline (services in turn on all GPUs).
        async_step_s: Step time of the split (slowest service plus weight sync).
        speedup: sync_step_s / async_step_s of the recommendation.
        overlap_bound: (R + T) / max(R, T) with R rollout and T the rest, measured on all GPUs.
        colocated: True when running in turn on all GPUs is recommended (τ = 0, or no split helps).
        feasible_gpus: The GPU counts each service fits on; the search considers all of them.
        plans: Per-service plans on their GPUs.
        explanation: Why.
    """

    tau: float
    gpus: dict[str, int]
    stage_seconds: dict[str, float]
    sync_step_s: float
    async_step_s: float
    speedup: float
    overlap_bound: float
    colocated: bool
    feasible_gpus: dict[str, tuple[int, ...]]
    plans: dict[str, ParallelPlan]
    explanation: tuple[str, ...]

    def table(self) -> str:
        """Human-readable split."""
        mode = "colocated, in turn" if self.colocated else "disaggregated, asynchronous"
        lines = [f"service split (τ = {self.tau:g}, {mode})", "  service     GPUs  s/step"]
        for name, n in self.gpus.items():
            lines.append(f"  {name:<10} {n:>5}  {self.stage_seconds[name]:>6.2f}")
        lines.append(
            f"  predicted speedup {self.speedup:.2f}× over synchronous ({self.sync_step_s:.2f} s → "
            f"{self.async_step_s:.2f} s per step); overlap bound (R+T)/max(R,T) = {self.overlap_bound:.2f}×"
        )
        lines.extend(f"  - {line}" for line in self.explanation)
        return "\n".join(lines)


def _plan(service: str, model: ModelSpec, workload: WorkloadSpec, cluster: ClusterSpec, world: int) -> ParallelPlan:
    if service == "rollout":
        return plan_rollout(model, workload, cluster, world_size=world)
    forward_only = service == "reference"
    return plan_training(model, workload, cluster, world_size=world, service=service, forward_only=forward_only)


def _plans_by_size(
    services: tuple[str, ...], model: ModelSpec, workload: WorkloadSpec, cluster: ClusterSpec
) -> dict[str, dict[int, ParallelPlan]]:
    """Each service's plan on every GPU count it fits on (1..num_gpus)."""
    out: dict[str, dict[int, ParallelPlan]] = {}
    for service in services:
        out[service] = {}
        for world in range(1, cluster.num_gpus + 1):
            try:
                out[service][world] = _plan(service, model, workload, cluster, world)
            except InfeasiblePlanError:
                continue
        if not out[service]:
            raise InfeasiblePlanError(
                f"{service} of {model.name} fits on no share of the {cluster.num_gpus} GPUs",
                float("inf"),
                cluster.usable_bytes,
                None,
            )
    return out


def _best_split(times: dict[str, dict[int, float]], total: int) -> tuple[float, dict[str, int]] | None:
    """The allocation of `total` GPUs minimising the slowest stage, over every feasible count per service."""
    services = list(times)
    best: tuple[float, dict[str, int]] | None = None
    for head in itertools.product(*(sorted(times[s]) for s in services[:-1])):
        last = total - sum(head)
        if last not in times[services[-1]]:
            continue
        alloc = dict(zip(services, (*head, last), strict=True))
        slowest = max(times[s][alloc[s]] for s in services)
        if best is None or slowest < best[0]:
            best = (slowest, alloc)
    return best


def split_services(
    model: ModelSpec,
    workload: WorkloadSpec,
    cluster: ClusterSpec,
    *,
    tau: float,
    algorithm: str = "grpo",
    measured: Throughputs | None = None,
) -> ServiceSplit:
    """Recommend GPUs per service and predict the asynchronous speedup.

    Each service is planned on every GPU count it fits on; its stage time there is that plan's predicted
    step time (or, with measured throughputs, samples / (rate · GPUs)). The synchronous baseline runs every
    service in turn on all GPUs and its rollout waits for the longest sample; with τ ≥ 1 rollout of step
    k + 1 overlaps training of step k, so a split's step time is its slowest service plus the weight
    broadcast, and rollout pays the mean length (continuous batching). τ = 0 forbids the overlap.

    Args:
        model: The model (policy, reference and critic share its size).
        workload: The step's samples.
        cluster: All GPUs to split.
        tau: Staleness bound (0 = on-policy).
        algorithm: ``"grpo"`` (rollout, trainer, reference) or ``"ppo"`` (adds a critic).
        measured: Measured per-GPU throughputs; predicted from the cost model when None.

    Returns:
        The recommendation, with per-service plans.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm: {algorithm!r} not in {sorted(ALGORITHMS)}")
    if tau < 0:
        raise ValueError(f"tau: must be >= 0, got {tau}")
    services = ALGORITHMS[algorithm]
    g, batch = cluster.num_gpus, workload.samples_per_step
    plans = _plans_by_size(services, model, workload, cluster)
    misfits = [s for s in services if g not in plans[s]]
    if misfits:
        msg = f"{', '.join(misfits)} of {model.name} do not fit on all {g} GPUs (the synchronous baseline)"
        raise InfeasiblePlanError(msg, float("inf"), cluster.usable_bytes, None)
    if measured is None:
        times = {s: {n: p.step_time_s for n, p in plans[s].items()} for s in services}
        gen = plans["rollout"][g].generation
        assert gen is not None
        sync_all = {s: times[s][g] for s in services} | {"rollout": gen.sync_s}
    else:
        rates = {"rollout": measured.rollout, "trainer": measured.trainer, "reference": measured.reference}
        rates["critic"] = measured.critic
        missing = [s for s in services if rates[s] <= 0]
        if missing:
            raise ValueError(f"measured: throughput for {missing} must be > 0 for algorithm {algorithm!r}")
        times = {s: {n: batch / (rates[s] * n) for n in plans[s]} for s in services}
        sync_all = {s: times[s][g] for s in services}
        if measured.rollout_sync > 0:
            sync_all["rollout"] = batch / (measured.rollout_sync * g)
    rollout_s = sync_all["rollout"]
    rest_s = sum(v for k, v in sync_all.items() if k != "rollout")
    sync_step = rollout_s + rest_s
    bound = sync_step / max(rollout_s, rest_s)
    weight_sync = BF16 * model.total_params() / (cluster.link_gbps(g) * 1e9)
    feasible = {s: tuple(sorted(plans[s])) for s in services}
    found = _best_split(times, g)
    best = (found[0] + weight_sync, found[1]) if found else None
    lines = [
        f"synchronous baseline: rollout {rollout_s:.2f} s then {' + '.join(s for s in services[1:])} "
        f"{rest_s:.2f} s on all {g} GPUs",
    ]
    if tau == 0 or best is None or best[0] >= sync_step:
        if tau == 0:
            lines.append("τ = 0 is strictly on-policy: rollout of step k+1 waits for update k, so nothing overlaps")
        elif best is None:
            lines.append(f"no split of {g} GPUs fits every service")
        else:
            lines.append(f"the best split ({best[0]:.2f} s per step) is slower than running in turn")
        alloc = dict.fromkeys(services, g)
        full = {s: plans[s][g] for s in services}
        return ServiceSplit(tau, alloc, sync_all, sync_step, sync_step, 1.0, bound, True, feasible, full, tuple(lines))
    step, alloc = best
    lines.append(
        f"τ = {tau:g} ≥ 1 lets rollout of step k+1 overlap update k; larger τ only absorbs variance, which this "
        "model does not predict"
    )
    lines.append(f"weight broadcast to rollout: {weight_sync:.2f} s per step")
    stage = {s: times[s][alloc[s]] for s in services}
    slowest = max(stage, key=lambda s: stage[s])
    lines.append(f"{slowest} is the slowest stage at {stage[slowest]:.2f} s; the others wait on it")
    chosen = {s: plans[s][alloc[s]] for s in services}
    speedup = sync_step / step
    if math.isfinite(speedup) and speedup > bound:
        lines.append("the speedup exceeds the overlap bound because async rollout also skips the long-tail wait")
    return ServiceSplit(tau, alloc, stage, sync_step, step, speedup, bound, False, feasible, chosen, tuple(lines))
