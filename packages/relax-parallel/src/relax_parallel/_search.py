"""Search over valid layouts for training and scoring services, with explanations."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace

from relax_parallel._config import ParallelConfig
from relax_parallel._memory import MemoryBreakdown, training_memory
from relax_parallel._plan import ParallelPlan
from relax_parallel._specs import ClusterSpec, ModelSpec, WorkloadSpec
from relax_parallel._strategy import (
    MICRO_BATCH_CHOICES,
    encoder_placement,
    gib,
    modality_strategies,
    shard_vision_encoder,
)
from relax_parallel._time import TimeBreakdown, training_step_time

MIN_CP_CHUNK_TOKENS = 512  # megatron-core CP splits a sequence into 2·cp load-balanced chunks
SIMPLICITY_TOLERANCE = 0.01  # relative step-time difference treated as a tie


class InfeasiblePlanError(ValueError):
    """No valid layout fits in memory.

    Attributes:
        required_bytes: Per-GPU bytes of the smallest-footprint valid layout.
        available_bytes: Usable bytes per GPU.
        closest: That smallest-footprint layout, if any layout was valid at all.
    """

    def __init__(self, message: str, required_bytes: float, available_bytes: float, closest: ParallelConfig | None):
        super().__init__(message)
        self.required_bytes = required_bytes
        self.available_bytes = available_bytes
        self.closest = closest


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def config_violations(
    model: ModelSpec, workload: WorkloadSpec, cluster: ClusterSpec, cfg: ParallelConfig, world_size: int
) -> list[str]:
    """Reasons a layout is invalid (empty when valid). Memory is not checked here.

    Rules: the degrees multiply to the world size; tp divides the attention and KV heads (megatron-core
    splits query groups over TP) and stays within one node; pp divides the layers; ep divides the experts
    (and is 1 for a dense model); each of the 2·cp context chunks keeps at least 512 tokens; every DP rank
    gets at least one micro-batch; a TP-sharded vision encoder needs tp to divide its heads.
    """
    out = []
    if cfg.world_size != world_size:
        out.append(f"tp·pp·cp·dp = {cfg.world_size} != world size {world_size}")
    if model.num_heads % cfg.tp or model.num_kv_heads % cfg.tp:
        out.append(f"tp={cfg.tp} must divide num_heads={model.num_heads} and num_kv_heads={model.num_kv_heads}")
    if cfg.tp > cluster.gpus_per_node:
        out.append(f"tp={cfg.tp} exceeds gpus_per_node={cluster.gpus_per_node}")
    if model.num_layers % cfg.pp:
        out.append(f"pp={cfg.pp} must divide num_layers={model.num_layers}")
    if model.is_moe and model.num_experts % cfg.ep:
        out.append(f"ep={cfg.ep} must divide num_experts={model.num_experts}")
    if not model.is_moe and cfg.ep != 1:
        out.append(f"ep={cfg.ep} on a dense model")
    longest = max(workload.sequence_tokens(model, m)[1] for m in workload.active_modalities())
    if cfg.cp > 1 and longest < 2 * cfg.cp * MIN_CP_CHUNK_TOKENS:
        out.append(f"cp={cfg.cp} leaves chunks under {MIN_CP_CHUNK_TOKENS} tokens of a {longest}-token sequence")
    if cfg.dp * cfg.micro_batch > workload.samples_per_step:
        out.append(f"dp·micro_batch = {cfg.dp * cfg.micro_batch} exceeds {workload.samples_per_step} samples per step")
    if cfg.vision_tp and model.vision and model.vision.num_heads % cfg.tp:
        out.append(f"tp={cfg.tp} must divide the vision encoder's {model.vision.num_heads} heads")
    return out


def enumerate_configs(
    model: ModelSpec, workload: WorkloadSpec, cluster: ClusterSpec, world_size: int, *, forward_only: bool = False
) -> list[ParallelConfig]:
    """Every valid layout of `world_size` GPUs (vision-encoder sharding set by size, not searched)."""
    out = []
    recomputes = ("none",) if forward_only else ("none", "full")
    experts = _divisors(model.num_experts) if model.is_moe else [1]
    for tp, pp in itertools.product(_divisors(world_size), repeat=2):
        if world_size % (tp * pp):
            continue
        for cp in _divisors(world_size // (tp * pp)):
            dp = world_size // (tp * pp * cp)
            for ep, b, rec in itertools.product(experts, MICRO_BATCH_CHOICES, recomputes):
                if (dp * cp) % ep:
                    continue
                vision_tp = shard_vision_encoder(model, workload, cluster, tp)
                cfg = ParallelConfig(tp, pp, cp, ep, dp, b, rec, vision_tp=vision_tp)
                if not config_violations(model, workload, cluster, cfg, world_size):
                    out.append(cfg)
    return out


@dataclass(frozen=True)
class _Evaluation:
    cfg: ParallelConfig
    memory: MemoryBreakdown
    modality: str
    time: TimeBreakdown


def _evaluate_memory(
    model: ModelSpec, workload: WorkloadSpec, cfg: ParallelConfig, forward_only: bool
) -> tuple[MemoryBreakdown, str]:
    per_modality = {
        m: training_memory(model, workload, cfg, m, forward_only=forward_only) for m in workload.active_modalities()
    }
    modality = max(per_modality, key=lambda m: per_modality[m].total)
    return per_modality[modality], modality


def _infeasible(
    model: ModelSpec,
    workload: WorkloadSpec,
    cluster: ClusterSpec,
    evals: list[tuple[ParallelConfig, MemoryBreakdown, str]],
) -> InfeasiblePlanError:
    limit = cluster.usable_bytes
    if not evals:
        return InfeasiblePlanError(
            f"no valid layout of {model.name} on {cluster.num_gpus} GPUs: heads {model.num_heads}/"
            f"{model.num_kv_heads} KV, {model.num_layers} layers and {workload.samples_per_step} samples per step "
            "admit no tp·pp·cp·dp factorisation",
            float("inf"),
            limit,
            None,
        )
    cfg, memory, modality = min(evals, key=lambda e: e[1].total)
    term, size = memory.largest()
    seq = workload.sequence_tokens(model, modality)[1]
    return InfeasiblePlanError(
        f"{model.name} does not fit on {cluster.num_gpus} × {cluster.gpu_memory_gib:g} GiB GPUs: the smallest "
        f"per-GPU footprint of {len(evals)} valid layouts ({cfg.short()}) needs {gib(memory.total)} for "
        f"{modality} samples of {seq:,} tokens, {gib(memory.total - limit)} over the {gib(limit)} usable; "
        f"largest term: {term} {gib(size)}",
        memory.total,
        limit,
        cfg,
    )


def _relaxations(cfg: ParallelConfig) -> list[tuple[str, ParallelConfig]]:
    """Simpler neighbours: one degree halved (dp doubled to keep the world size) or recomputation off."""
    out: list[tuple[str, ParallelConfig]] = []
    if cfg.recompute != "none":
        out.append(("recompute", replace(cfg, recompute="none")))
    for knob in ("tp", "cp", "pp"):
        value = getattr(cfg, knob)
        if value > 1 and value % 2 == 0:
            out.append((knob, replace(cfg, **{knob: value // 2, "dp": cfg.dp * 2})))
    if cfg.ep > 1 and cfg.ep % 2 == 0:
        out.append(("ep", replace(cfg, ep=cfg.ep // 2)))
    return out


def _explain(
    model: ModelSpec, workload: WorkloadSpec, cluster: ClusterSpec, best: _Evaluation, forward_only: bool
) -> tuple[str, list[str]]:
    limit = cluster.usable_bytes
    lines: list[str] = []
    memory_reasons: list[str] = []
    for knob, relaxed in _relaxations(best.cfg):
        if config_violations(model, workload, cluster, relaxed, best.cfg.world_size):
            relaxed = replace(relaxed, micro_batch=1)
            if config_violations(model, workload, cluster, relaxed, best.cfg.world_size):
                continue
        shown = f"{knob}={getattr(relaxed, knob)}"
        mem, modality = _evaluate_memory(model, workload, relaxed, forward_only)
        if mem.total > limit:
            term, size = mem.largest()
            seq = workload.sequence_tokens(model, modality)[1]
            lines.append(
                f"{knob}={getattr(best.cfg, knob)}: with {shown} the {seq:,}-token {modality} samples need "
                f"{gib(mem.total)} > {gib(limit)} usable; {term} ({gib(size)}) is the largest term"
            )
            if term in ("weights", "gradients", "optimizer"):
                memory_reasons.append(f"memory: model states ({term} {gib(size)} is the largest term)")
            else:
                memory_reasons.append(f"memory: {term} of the {seq:,}-token {modality} sequences")
        else:
            t = training_step_time(model, workload, cluster, relaxed, mem.gradients, train=not forward_only)
            delta = {k: v - getattr(best.time, k) for k, v in vars(t).items()}
            worst = max(delta, key=lambda k: delta[k])
            lines.append(
                f"{knob}={getattr(best.cfg, knob)}: {shown} also fits ({gib(mem.total)}) but is slower "
                f"({t.total:.2f} s vs {best.time.total:.2f} s per step; {worst} +{delta[worst]:.2f} s)"
            )
    c = best.cfg
    m = c.micro_batches(workload.samples_per_step)
    if c.pp > 1:
        lines.append(f"pipeline: {m} micro-batches of {c.micro_batch}; 1F1B bubble (p−1)/m = {(c.pp - 1) / m:.3f}")
    if c.dp > 1 and not forward_only:
        lines.append(f"dp={c.dp}: remaining GPUs replicate the model; gradient reduction {best.time.dp_comm:.2f} s")
    if memory_reasons:
        binding = memory_reasons[0]
    else:
        terms = vars(best.time)
        dominant = max(terms, key=lambda k: terms[k])
        binding = f"step time: every simpler layout fits, this is the fastest predicted (largest cost: {dominant})"
    return binding, lines


def plan_training(
    model: ModelSpec,
    workload: WorkloadSpec,
    cluster: ClusterSpec,
    *,
    world_size: int | None = None,
    service: str = "trainer",
    forward_only: bool = False,
    allowed: Callable[[ParallelConfig], bool] | None = None,
) -> ParallelPlan:
    """Pick the fastest predicted valid layout that fits in memory for a training or scoring service.

    Layouts predicted within 1 % of the fastest count as ties, broken toward less model parallelism.

    Args:
        model: The model.
        workload: The step's samples.
        cluster: Hardware; its num_gpus is used unless world_size is given.
        world_size: GPUs given to this service.
        service: Name recorded on the plan (trainer, critic, reference).
        forward_only: Scoring service (reference, critic inference): no gradients or optimizer.
        allowed: Only layouts it accepts are searched (what the executing engine can realise, e.g. no pipeline
            stages); None: every valid layout.

    Returns:
        The plan with predictions and explanation.

    Raises:
        InfeasiblePlanError: Nothing fits; the message says what and by how much.
    """
    world = world_size or cluster.num_gpus
    configs = enumerate_configs(model, workload, cluster, world, forward_only=forward_only)
    if allowed is not None:
        configs = [cfg for cfg in configs if allowed(cfg)]
    sized = [(cfg, *_evaluate_memory(model, workload, cfg, forward_only)) for cfg in configs]
    evals = [
        _Evaluation(
            cfg,
            memory,
            modality,
            training_step_time(model, workload, cluster, cfg, memory.gradients, train=not forward_only),
        )
        for cfg, memory, modality in sized
        if memory.total <= cluster.usable_bytes
    ]
    if not evals:
        raise _infeasible(model, workload, cluster, sized)
    fastest = min(e.time.total for e in evals)
    # Predictions closer than SIMPLICITY_TOLERANCE are within the model's error: among those, take the layout
    # with the least model parallelism and no recomputation, then the fastest.
    near = [e for e in evals if e.time.total <= fastest * (1 + SIMPLICITY_TOLERANCE)]
    best = min(near, key=lambda e: (e.cfg.tp * e.cfg.pp * e.cfg.cp, e.cfg.recompute == "full", e.cfg.ep, e.time.total))
    binding, lines = _explain(model, workload, cluster, best, forward_only)
    return ParallelPlan(
        service=service,
        config=best.cfg,
        memory=best.memory,
        memory_limit=cluster.usable_bytes,
        binding_modality=best.modality,
        time=best.time,
        generation=None,
        binding_constraint=binding,
        explanation=tuple(lines),
        modalities=modality_strategies(model, workload, cluster, best.cfg) if not forward_only else (),
        encoder_placement=encoder_placement(model, workload, best.cfg),
    )
