"""Rollout (generation) service planning: TP degree per inference engine, replicas, KV-cache concurrency."""

from __future__ import annotations

import math

from relax_parallel._config import ParallelConfig
from relax_parallel._memory import (
    MemoryBreakdown,
    inference_weight_bytes,
    kv_cache_bytes_per_token,
    layer_activation_bytes,
)
from relax_parallel._plan import ParallelPlan
from relax_parallel._search import InfeasiblePlanError
from relax_parallel._specs import ClusterSpec, ModelSpec, WorkloadSpec
from relax_parallel._strategy import encoder_placement, gib
from relax_parallel._time import GenerationEstimate, generation_estimate

# Tokens one prefill chunk processes at once (vLLM's max_num_batched_tokens order of magnitude).
PREFILL_CHUNK_TOKENS = 8192


def _rollout_memory(
    model: ModelSpec, workload: WorkloadSpec, cluster: ClusterSpec, tp: int, replicas: int
) -> tuple[MemoryBreakdown, int, int]:
    """(memory at chosen concurrency, concurrency, longest sequence) for one engine of `tp` GPUs."""
    longest = max(workload.sequence_tokens(model, m)[1] for m in workload.active_modalities())
    weights = inference_weight_bytes(model, tp)
    workspace = layer_activation_bytes(model, PREFILL_CHUNK_TOKENS, 1, ParallelConfig(tp=tp))
    per_seq = kv_cache_bytes_per_token(model, tp) * longest
    wanted = math.ceil(workload.samples_per_step / replicas)
    # Reserve KV for the longest sequence so nothing is preempted mid-generation.
    fits = math.floor((cluster.usable_bytes - weights - workspace) / per_seq)
    concurrency = max(0, min(wanted, fits))
    kv = max(concurrency, 1) * per_seq
    return MemoryBreakdown(weights=weights, activations=workspace, kv_cache=kv), concurrency, longest


def plan_rollout(
    model: ModelSpec, workload: WorkloadSpec, cluster: ClusterSpec, *, world_size: int | None = None
) -> ParallelPlan:
    """Choose the inference TP degree and replica count with the shortest predicted rollout step.

    Valid TP degrees divide the query heads, stay within a node, and either divide or are divisible by the
    KV heads (KV heads are replicated when tp exceeds them).

    Args:
        model: The model.
        workload: The step's samples.
        cluster: Hardware.
        world_size: GPUs given to rollout (default: all).

    Returns:
        The rollout plan; ``dp`` is the number of engine replicas.

    Raises:
        InfeasiblePlanError: Weights plus one longest sequence's KV cache do not fit at any TP degree.
    """
    world = world_size or cluster.num_gpus
    options: list[tuple[int, MemoryBreakdown, int, GenerationEstimate]] = []
    smallest: tuple[int, MemoryBreakdown] | None = None
    for tp in range(1, min(world, cluster.gpus_per_node) + 1):
        kv = model.num_kv_heads
        if world % tp or model.num_heads % tp or (kv % tp and tp % kv):
            continue
        memory, concurrency, _ = _rollout_memory(model, workload, cluster, tp, world // tp)
        if concurrency < 1:
            if smallest is None or memory.total < smallest[1].total:
                smallest = (tp, memory)
            continue
        est = generation_estimate(model, workload, cluster, tp, world // tp, concurrency)
        options.append((tp, memory, concurrency, est))
    if not options:
        need = smallest[1].total if smallest else float("inf")
        raise InfeasiblePlanError(
            f"rollout of {model.name} does not fit on {world} × {cluster.gpu_memory_gib:g} GiB GPUs: weights plus "
            f"the KV cache of one longest sequence need {gib(need)} per GPU, "
            f"{gib(need - cluster.usable_bytes)} over the {gib(cluster.usable_bytes)} usable",
            need,
            cluster.usable_bytes,
            None,
        )
    tp, memory, concurrency, est = min(options, key=lambda o: (round(o[3].async_s, 6), o[0]))
    lines = []
    for other_tp, _, other_c, other in options:
        if other_tp != tp:
            lines.append(
                f"tp={other_tp}: {other.async_s:.2f} s per step ({other_c} concurrent sequences per engine) "
                f"vs {est.async_s:.2f} s"
            )
    replicas = world // tp
    wanted = math.ceil(workload.samples_per_step / replicas)
    if concurrency < wanted:
        binding = (
            f"memory: KV cache holds {concurrency} of {wanted} sequences per engine "
            f"({gib(memory.kv_cache)} of KV), so the step runs in {math.ceil(wanted / concurrency)} waves"
        )
    else:
        binding = (
            f"HBM bandwidth: decode is memory-bound, {est.decode_step_s * 1e3:.1f} ms per step reading "
            f"{gib(memory.weights)} of weights plus the live KV cache"
        )
    lines.append(
        f"sync vs async: waiting for the {workload.max_response_tokens}-token tail costs {est.sync_s:.2f} s per step; "
        f"continuous batching pays the {workload.response_tokens}-token mean, {est.async_s:.2f} s"
    )
    return ParallelPlan(
        service="rollout",
        config=ParallelConfig(tp=tp, dp=replicas),
        memory=memory,
        memory_limit=cluster.usable_bytes,
        binding_modality=max(workload.active_modalities(), key=lambda m: workload.sequence_tokens(model, m)[1]),
        time=None,
        generation=est,
        binding_constraint=binding,
        explanation=tuple(lines),
        encoder_placement=encoder_placement(model, workload, ParallelConfig(tp=tp), inference=True),
    )
